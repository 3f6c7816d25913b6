"""Amounts of money as integers of minor units (cents), with rounding, parsing and formatting."""

from __future__ import annotations

from collections.abc import Sequence

ROUNDING_MODES = ("half_up", "half_even", "down", "up")
BASIS_POINTS = 10_000


def round_div(numerator: int, denominator: int, mode: str = "half_even") -> int:
    """``numerator / denominator`` rounded to an integer.

    ``half_up`` rounds ties away from zero, ``half_even`` to the even neighbour, ``down``
    towards zero and ``up`` away from zero. Negative numerators round symmetrically.
    """
    if denominator <= 0:
        raise ValueError("denominator must be positive")
    if mode not in ROUNDING_MODES:
        raise ValueError(f"unknown rounding mode {mode!r}")
    sign = -1 if numerator < 0 else 1
    quotient, remainder = divmod(abs(numerator), denominator)
    if remainder == 0 or mode == "down":
        return sign * quotient
    if mode == "up":
        return sign * (quotient + 1)
    twice = 2 * remainder
    if twice > denominator:
        quotient += 1
    elif twice == denominator:
        if mode == "half_up" or quotient % 2 == 1:
            quotient += 1
    return sign * quotient


def percent_of(amount: int, basis_points: int, mode: str = "half_even") -> int:
    """``amount`` times ``basis_points`` / 10000 (150 basis points = 1.5 %), rounded."""
    return round_div(amount * basis_points, BASIS_POINTS, mode)


def parse_amount(text: str, decimals: int = 2) -> int:
    """Parse ``"1,234.5"``, ``"-3"``, ``"(12.00)"`` or ``"$7.25"`` into minor units.

    Parentheses mean a negative amount; at most ``decimals`` fraction digits are accepted.
    """
    text = text.strip()
    negative = False
    if text.startswith("(") and text.endswith(")"):
        negative, text = True, text[1:-1].strip()
    if text.startswith("-"):
        negative, text = not negative, text[1:].strip()
    text = text.lstrip("$").replace(",", "")
    if text in ("", "."):
        raise ValueError("no digits in amount")
    whole, _, fraction = text.partition(".")
    if whole == "":
        whole = "0"
    if not whole.isdigit() or (fraction and not fraction.isdigit()):
        raise ValueError(f"not an amount: {text!r}")
    if len(fraction) > decimals:
        raise ValueError(f"more than {decimals} decimal places in {text!r}")
    minor = int(whole) * int(10**decimals) + int(fraction.ljust(decimals, "0") or "0")
    return -minor if negative else minor


def group_thousands(digits: str, separator: str = ",") -> str:
    """Insert ``separator`` between groups of three digits, counting from the right."""
    head = len(digits) % 3
    groups = [digits[:head]] if head else []
    groups.extend(digits[i : i + 3] for i in range(head, len(digits), 3))
    return separator.join(groups)


def format_amount(
    minor: int,
    decimals: int = 2,
    thousands: str = ",",
    point: str = ".",
    accounting: bool = False,
) -> str:
    """Write minor units as ``"-1,234.50"``; ``accounting`` writes negatives as ``"(1,234.50)"``."""
    whole, fraction = divmod(abs(minor), int(10**decimals))
    text = group_thousands(str(whole), thousands)
    if decimals > 0:
        text += point + str(fraction).rjust(decimals, "0")
    if minor < 0:
        return f"({text})" if accounting else f"-{text}"
    return text


def split_evenly(total: int, parts: int) -> list[int]:
    """Split ``total`` into ``parts`` amounts differing by at most one; larger ones first."""
    if parts < 1:
        raise ValueError("parts must be at least 1")
    base, extra = divmod(abs(total), parts)
    sign = -1 if total < 0 else 1
    return [sign * (base + 1 if i < extra else base) for i in range(parts)]


def allocate(total: int, weights: Sequence[int]) -> list[int]:
    """Split ``total`` in proportion to ``weights`` so the shares add up exactly.

    Each share is first rounded down; the units left over go to the largest remainders,
    the earliest weight winning a tie.
    """
    if any(w < 0 for w in weights):
        raise ValueError("weights must not be negative")
    weight_sum = sum(weights)
    if weight_sum == 0:
        raise ValueError("weights must not all be zero")
    shares = [total * w // weight_sum for w in weights]
    remainders = [total * w % weight_sum for w in weights]
    left = total - sum(shares)
    order = sorted(range(len(weights)), key=lambda i: (-remainders[i], i))
    for i in order[:left]:
        shares[i] += 1
    return shares
