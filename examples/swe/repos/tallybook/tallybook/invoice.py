"""Invoices: lines with discounts and tax codes, payments, late fees and a text rendering."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .money import format_amount, percent_of
from .tax import TaxRate, format_rate, taxes_by_code, tax_for

DAYS_PER_MONTH = 30


@dataclass(frozen=True)
class Line:
    """``quantity`` units at ``unit_price`` minor units, less ``discount_bp`` basis points."""

    description: str
    quantity: int
    unit_price: int
    discount_bp: int = 0
    tax_code: str = "std"

    def gross(self) -> int:
        """Quantity times unit price, before the discount."""
        return self.quantity * self.unit_price

    def discount(self, mode: str = "half_even") -> int:
        """The discount, rounded to minor units."""
        return percent_of(self.gross(), self.discount_bp, mode)

    def net(self, mode: str = "half_even") -> int:
        """The line amount after the discount."""
        return self.gross() - self.discount(mode)


def volume_discount_bp(quantity: int, tiers: Sequence[tuple[int, int]]) -> int:
    """The discount of the highest tier ``(min_quantity, basis_points)`` that ``quantity`` reaches."""
    best = 0
    best_min = -1
    for min_quantity, basis_points in tiers:
        if quantity >= min_quantity and min_quantity > best_min:
            best, best_min = basis_points, min_quantity
    return best


class Invoice:
    """Lines, tax rates and payments; ``rounding`` is ``"per_line"`` or ``"per_invoice"``."""

    def __init__(
        self,
        rates: Mapping[str, TaxRate],
        rounding: str = "per_line",
        mode: str = "half_even",
    ) -> None:
        if rounding not in ("per_line", "per_invoice"):
            raise ValueError(f"unknown rounding {rounding!r}")
        self.rates = dict(rates)
        self.rounding = rounding
        self.mode = mode
        self.lines: list[Line] = []
        self.payments: list[int] = []

    def add(self, line: Line) -> None:
        """Add a line; its quantity must be positive and its tax code known."""
        if line.quantity <= 0:
            raise ValueError("quantity must be positive")
        if line.tax_code not in self.rates:
            raise ValueError(f"unknown tax code {line.tax_code!r}")
        self.lines.append(line)

    def subtotal(self) -> int:
        """The sum of the line amounts (which include any inclusive tax)."""
        return sum(line.net(self.mode) for line in self.lines)

    def tax_by_code(self) -> dict[str, int]:
        """Tax per code: rounded on every line, or once per code on the summed amounts."""
        if self.rounding == "per_invoice":
            amounts: dict[str, int] = {}
            for line in self.lines:
                amounts[line.tax_code] = amounts.get(line.tax_code, 0) + line.net(self.mode)
            return taxes_by_code(amounts, self.rates, self.mode)
        result: dict[str, int] = {}
        for line in sorted(self.lines, key=lambda ln: ln.tax_code):
            tax = tax_for(line.net(self.mode), self.rates[line.tax_code], self.mode)
            result[line.tax_code] = result.get(line.tax_code, 0) + tax
        return result

    def tax_total(self) -> int:
        """All tax, inclusive and exclusive."""
        return sum(self.tax_by_code().values())

    def total(self) -> int:
        """What the customer owes: the subtotal plus the exclusive taxes."""
        extra = sum(
            tax for code, tax in self.tax_by_code().items() if not self.rates[code].inclusive
        )
        return self.subtotal() + extra

    def pay(self, amount: int) -> None:
        """Record a payment of a positive amount."""
        if amount <= 0:
            raise ValueError("a payment must be positive")
        self.payments.append(amount)

    def paid(self) -> int:
        """The sum of the payments."""
        return sum(self.payments)

    def balance(self) -> int:
        """What is still owed; negative when overpaid."""
        return self.total() - self.paid()

    def status(self) -> str:
        """``"open"``, ``"partial"``, ``"paid"`` or ``"overpaid"``."""
        balance = self.balance()
        if balance < 0:
            return "overpaid"
        if balance == 0:
            return "paid"
        if self.paid() > 0:
            return "partial"
        return "open"

    def late_fee(self, days_late: int, grace_days: int = 0, monthly_bp: int = 150) -> int:
        """Interest on the balance for each started 30-day month past the grace period."""
        overdue = days_late - grace_days
        balance = self.balance()
        if overdue <= 0 or balance <= 0:
            return 0
        months = (overdue + DAYS_PER_MONTH - 1) // DAYS_PER_MONTH
        return percent_of(balance, monthly_bp * months, self.mode)

    def render(self, width: int = 40) -> str:
        """The invoice as text, one ``label ..... amount`` row per line and per total."""
        rows = [_row(f"{ln.quantity} x {ln.description}", ln.net(self.mode), width)
                for ln in self.lines]
        rows.append(_row("Subtotal", self.subtotal(), width))
        for code, tax in self.tax_by_code().items():
            rate = self.rates[code]
            label = f"Tax {code} {format_rate(rate.basis_points)}"
            if rate.inclusive:
                label += " incl."
            rows.append(_row(label, tax, width))
        rows.append(_row("Total", self.total(), width))
        if self.payments:
            rows.append(_row("Paid", self.paid(), width))
            rows.append(_row("Balance", self.balance(), width))
        return "\n".join(rows)


def _row(label: str, amount: int, width: int) -> str:
    """``label`` and ``amount`` with dots between them, ``width`` characters in all."""
    text = format_amount(amount)
    room = width - len(text) - 2
    if len(label) > room:
        label = label[: max(room - 1, 0)] + "~"
    return label + " " + "." * (room - len(label)) + " " + text
