"""``SpanSet``: a set of integers stored as sorted, disjoint, non-adjacent spans."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator

from .span import Span


def normalize(spans: Iterable[Span]) -> list[Span]:
    """Sort ``spans``, drop empty ones and merge those that overlap or touch."""
    ordered = sorted(s for s in spans if not s.is_empty())
    merged: list[Span] = []
    for span in ordered:
        if merged and span.start <= merged[-1].end:
            top = merged[-1]
            merged[-1] = Span(top.start, max(top.end, span.end))
        else:
            merged.append(span)
    return merged


class SpanSet:
    """An immutable set of integers, kept as a normalized list of spans."""

    __slots__ = ("_spans", "_starts")

    def __init__(self, spans: Iterable[Span] = ()) -> None:
        self._spans: tuple[Span, ...] = tuple(normalize(spans))
        self._starts: list[int] = [s.start for s in self._spans]

    @classmethod
    def of(cls, *values: int) -> SpanSet:
        """The set holding exactly the given integers."""
        return cls(Span(v, v + 1) for v in values)

    @property
    def spans(self) -> tuple[Span, ...]:
        """The normalized spans, in ascending order."""
        return self._spans

    def __iter__(self) -> Iterator[int]:
        for span in self._spans:
            yield from range(span.start, span.end)

    def __len__(self) -> int:
        return sum(s.length for s in self._spans)

    def __bool__(self) -> bool:
        return bool(self._spans)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SpanSet):
            return NotImplemented
        return self._spans == other._spans

    def __hash__(self) -> int:
        return hash(self._spans)

    def __repr__(self) -> str:
        inner = ", ".join(f"[{s.start}, {s.end})" for s in self._spans)
        return f"SpanSet({inner})"

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, int):
            return False
        index = bisect_right(self._starts, value) - 1
        if index < 0:
            return False
        return self._spans[index].contains(value)

    def bounds(self) -> Span | None:
        """The smallest span covering the whole set, or ``None`` when empty."""
        if not self._spans:
            return None
        return Span(self._spans[0].start, self._spans[-1].end)

    def union(self, other: SpanSet) -> SpanSet:
        """Integers in either set."""
        return SpanSet(self._spans + other._spans)

    def intersection(self, other: SpanSet) -> SpanSet:
        """Integers in both sets, by a merge-style sweep over the two span lists."""
        result: list[Span] = []
        left, right = self._spans, other._spans
        i = j = 0
        for _ in range(len(left) + len(right)):
            if i >= len(left) or j >= len(right):
                break
            common = left[i].intersection(right[j])
            if common is not None:
                result.append(common)
            if left[i].end < right[j].end:
                i += 1
            else:
                j += 1
        return SpanSet(result)

    def difference(self, other: SpanSet) -> SpanSet:
        """Integers in this set but not in ``other``."""
        result: list[Span] = []
        for span in self._spans:
            cursor = span.start
            for hole in other._spans:
                if hole.start >= span.end:
                    break
                if hole.start > cursor:
                    result.append(Span(cursor, hole.start))
                cursor = max(cursor, hole.end)
            if cursor < span.end:
                result.append(Span(cursor, span.end))
        return SpanSet(result)

    def gaps(self) -> list[Span]:
        """The spans missing between the set's first and last element."""
        return [
            Span(before.end, after.start)
            for before, after in zip(self._spans, self._spans[1:])
        ]

    def complement(self, within: Span) -> SpanSet:
        """Integers of ``within`` that are not in the set."""
        return SpanSet([within]).difference(self)

    def clip(self, within: Span) -> SpanSet:
        """The part of the set inside ``within``."""
        return self.intersection(SpanSet([within]))

    def nth(self, index: int) -> int:
        """The ``index``-th smallest integer of the set (0-based; negatives count from the end)."""
        size = len(self)
        if index < 0:
            index += size
        if index < 0 or index >= size:
            raise IndexError(f"index out of range for a set of {size} integers")
        for span in self._spans:
            if index < span.length:
                return span.start + index
            index -= span.length
        raise AssertionError("unreachable")

    def take(self, first: int, stop: int) -> SpanSet:
        """The integers whose rank (0-based position in ascending order) is in ``[first, stop)``."""
        picked: list[Span] = []
        offset = 0
        for span in self._spans:
            lo = max(first - offset, 0)
            hi = min(stop - offset, span.length)
            if lo < hi:
                picked.append(Span(span.start + lo, span.start + hi))
            offset += span.length
        return SpanSet(picked)

    def chunks(self, size: int) -> list[SpanSet]:
        """Split the set, in order, into pieces of ``size`` integers (the last may be smaller)."""
        if size < 1:
            raise ValueError("chunk size must be at least 1")
        return [self.take(first, first + size) for first in range(0, len(self), size)]

    def largest_gap(self) -> Span | None:
        """The widest gap (the first one on ties), or ``None`` when there is no gap."""
        best: Span | None = None
        for gap in self.gaps():
            if best is None or gap.length > best.length:
                best = gap
        return best
