"""spanset: sets of integers stored as spans, with range-list and mask text forms."""

from .rangeset import SpanSet, normalize
from .span import Span
from .text import format_ranges, from_mask, parse_item, parse_ranges, summarize, to_mask

__all__ = [
    "Span",
    "SpanSet",
    "format_ranges",
    "from_mask",
    "normalize",
    "parse_item",
    "parse_ranges",
    "summarize",
    "to_mask",
]
