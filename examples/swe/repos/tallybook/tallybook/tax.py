"""Tax rates in basis points: exclusive and inclusive tax, and progressive brackets."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .money import BASIS_POINTS, percent_of, round_div


@dataclass(frozen=True)
class TaxRate:
    """A named rate; ``inclusive`` rates are already contained in the prices they apply to."""

    code: str
    basis_points: int
    inclusive: bool = False

    def __post_init__(self) -> None:
        if self.basis_points < 0:
            raise ValueError(f"tax rate {self.code!r} is negative")


def format_rate(basis_points: int) -> str:
    """A rate as a percentage without trailing zeros: 2000 -> ``"20%"``, 550 -> ``"5.5%"``."""
    whole, fraction = divmod(basis_points, 100)
    if fraction == 0:
        return f"{whole}%"
    return f"{whole}.{fraction:02d}".rstrip("0") + "%"


def tax_on_net(net: int, basis_points: int, mode: str = "half_even") -> int:
    """The tax to add on top of a net amount."""
    return percent_of(net, basis_points, mode)


def tax_in_gross(gross: int, basis_points: int, mode: str = "half_even") -> int:
    """The tax contained in a gross (tax-inclusive) amount."""
    net = round_div(gross * BASIS_POINTS, BASIS_POINTS + basis_points, mode)
    return gross - net


def tax_for(amount: int, rate: TaxRate, mode: str = "half_even") -> int:
    """The tax for ``amount`` under ``rate``, whether the rate is inclusive or not."""
    if rate.inclusive:
        return tax_in_gross(amount, rate.basis_points, mode)
    return tax_on_net(amount, rate.basis_points, mode)


def bracket_tax(
    income: int, brackets: Sequence[tuple[int | None, int]], mode: str = "half_even"
) -> int:
    """Progressive tax: ``brackets`` are ``(upper_limit, basis_points)`` in ascending order.

    The part of ``income`` up to the first limit is taxed at the first rate, the part between
    the first and second limit at the second, and so on; a limit of ``None`` is unbounded.
    The tax is rounded once, at the end.
    """
    if income <= 0:
        return 0
    scaled = 0
    lower = 0
    for upper, basis_points in brackets:
        if upper is not None and upper <= lower:
            raise ValueError("bracket limits must increase")
        top = income if upper is None else min(income, upper)
        scaled += (top - lower) * basis_points
        if upper is None or income <= upper:
            return round_div(scaled, BASIS_POINTS, mode)
        lower = upper
    raise ValueError("income is above the last bracket")


def effective_rate(tax: int, base: int) -> int:
    """``tax`` as basis points of ``base``, rounded half-even; 0 for a base of 0 or less."""
    if base <= 0:
        return 0
    return round_div(tax * BASIS_POINTS, base)


def taxes_by_code(
    amounts: Mapping[str, int], rates: Mapping[str, TaxRate], mode: str = "half_even"
) -> dict[str, int]:
    """The tax for each code's total amount, in code order."""
    result: dict[str, int] = {}
    for code in sorted(amounts):
        if code not in rates:
            raise ValueError(f"unknown tax code {code!r}")
        result[code] = tax_for(amounts[code], rates[code], mode)
    return result
