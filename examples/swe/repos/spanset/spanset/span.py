"""A single half-open integer interval ``[start, end)``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Span:
    """The integers ``start, start + 1, ..., end - 1``.

    A span with ``start == end`` is empty; ``start > end`` is rejected.
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start > self.end:
            raise ValueError(f"span start {self.start} is after its end {self.end}")

    @classmethod
    def closed(cls, first: int, last: int) -> Span:
        """The span holding ``first`` through ``last``, both included."""
        return cls(first, last + 1)

    @property
    def length(self) -> int:
        """How many integers the span holds."""
        return self.end - self.start

    @property
    def last(self) -> int:
        """The largest integer in the span; an empty span has none."""
        if self.start == self.end:
            raise ValueError("an empty span has no last element")
        return self.end - 1

    def is_empty(self) -> bool:
        """True when the span holds no integers."""
        return self.start == self.end

    def contains(self, value: int) -> bool:
        """True when ``value`` lies inside the span."""
        return self.start <= value < self.end

    def covers(self, other: Span) -> bool:
        """True when every integer of ``other`` is also in this span."""
        if other.is_empty():
            return True
        return self.start <= other.start and other.end <= self.end

    def overlaps(self, other: Span) -> bool:
        """True when the two spans share at least one integer."""
        return self.start < other.end and other.start < self.end

    def touches(self, other: Span) -> bool:
        """True when the spans overlap or sit directly next to each other."""
        return self.start <= other.end and other.start <= self.end

    def intersection(self, other: Span) -> Span | None:
        """The integers both spans hold, or ``None`` when they share none."""
        lo = max(self.start, other.start)
        hi = min(self.end, other.end)
        if lo >= hi:
            return None
        return Span(lo, hi)

    def hull(self, other: Span) -> Span:
        """The smallest span holding both spans (and anything between them)."""
        return Span(min(self.start, other.start), max(self.end, other.end))

    def split_at(self, value: int) -> tuple[Span, Span]:
        """Split into ``[start, value)`` and ``[value, end)``; ``value`` is clamped."""
        cut = min(max(value, self.start), self.end)
        return Span(self.start, cut), Span(cut, self.end)

    def shift(self, offset: int) -> Span:
        """The span moved by ``offset``."""
        return Span(self.start + offset, self.end + offset)

    def distance(self, other: Span) -> int:
        """How many integers lie strictly between the two spans (0 if they touch)."""
        if self.touches(other):
            return 0
        if self.end < other.start:
            return other.start - self.end
        return self.start - other.end
