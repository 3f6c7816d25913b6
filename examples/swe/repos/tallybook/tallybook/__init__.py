"""tallybook: money in minor units, rounding, tax rules and invoices."""

from .invoice import Invoice, Line, volume_discount_bp
from .money import (
    ROUNDING_MODES,
    allocate,
    format_amount,
    group_thousands,
    parse_amount,
    percent_of,
    round_div,
    split_evenly,
)
from .tax import (
    TaxRate,
    bracket_tax,
    effective_rate,
    format_rate,
    tax_for,
    tax_in_gross,
    tax_on_net,
    taxes_by_code,
)

__all__ = [
    "ROUNDING_MODES",
    "Invoice",
    "Line",
    "TaxRate",
    "allocate",
    "bracket_tax",
    "effective_rate",
    "format_amount",
    "format_rate",
    "group_thousands",
    "parse_amount",
    "percent_of",
    "round_div",
    "split_evenly",
    "tax_for",
    "tax_in_gross",
    "tax_on_net",
    "taxes_by_code",
    "volume_discount_bp",
]
