"""Reading and writing span sets as text: range lists (``"1-3,7,9-12"``) and masks (``"##..#"``)."""

from __future__ import annotations

from .rangeset import SpanSet
from .span import Span


def _parse_bound(token: str, item: str) -> int:
    token = token.strip()
    if not token.isdigit():
        raise ValueError(f"bad number {token!r} in range item {item!r}")
    return int(token)


def parse_item(item: str, lower: int, upper: int | None) -> Span:
    """One range item: ``"7"``, ``"3-9"`` (both ends included), ``"5-"`` or ``"-4"``.

    An open end is filled in from ``lower`` / ``upper``; ``"5-"`` needs ``upper``.
    """
    if "-" not in item:
        value = _parse_bound(item, item)
        return Span.closed(value, value)
    head, _, tail = item.partition("-")
    first = lower if head.strip() == "" else _parse_bound(head, item)
    if tail.strip() == "":
        if upper is None:
            raise ValueError(f"open range {item!r} needs an upper limit")
        last = upper
    else:
        last = _parse_bound(tail, item)
    if first > last:
        raise ValueError(f"range {item!r} runs backwards")
    return Span.closed(first, last)


def parse_ranges(text: str, lower: int = 0, upper: int | None = None) -> SpanSet:
    """Parse a comma-separated range list into a ``SpanSet``.

    Every value must lie in ``[lower, upper]`` (``upper`` included; ``None`` means no limit).
    Empty items (``"1,,3"``) are ignored.
    """
    spans: list[Span] = []
    for raw in text.split(","):
        if raw.strip() == "":
            continue
        span = parse_item(raw, lower, upper)
        if span.start < lower:
            raise ValueError(f"range {raw.strip()!r} starts below {lower}")
        if upper is not None and span.last > upper:
            raise ValueError(f"range {raw.strip()!r} ends above {upper}")
        spans.append(span)
    return SpanSet(spans)


def format_ranges(values: SpanSet, sep: str = ",", min_run: int = 2) -> str:
    """Write ``values`` as a range list; runs shorter than ``min_run`` are listed one by one."""
    parts: list[str] = []
    for span in values.spans:
        if span.length >= min_run and span.length > 1:
            parts.append(f"{span.start}-{span.last}")
        else:
            parts.extend(str(v) for v in range(span.start, span.end))
    return sep.join(parts)


def from_mask(mask: str, offset: int = 0, mark: str = "#") -> SpanSet:
    """The positions (plus ``offset``) at which ``mask`` holds ``mark``."""
    spans: list[Span] = []
    run_start: int | None = None
    for index, char in enumerate(mask):
        if char == mark and run_start is None:
            run_start = index
        elif char != mark and run_start is not None:
            spans.append(Span(run_start + offset, index + offset))
            run_start = None
    if run_start is not None:
        spans.append(Span(run_start + offset, len(mask) + offset))
    return SpanSet(spans)


def to_mask(values: SpanSet, within: Span, mark: str = "#", blank: str = ".") -> str:
    """A string with one character per integer of ``within``: ``mark`` if in ``values``."""
    return "".join(mark if v in values else blank for v in range(within.start, within.end))


def summarize(values: SpanSet) -> str:
    """A one-line description, e.g. ``"7 values in 2 runs, 1-5 and 9-10"``."""
    count = len(values)
    if count == 0:
        return "no values"
    runs = len(values.spans)
    noun = "value" if count == 1 else "values"
    run_noun = "run" if runs == 1 else "runs"
    listed = [format_ranges(SpanSet([s])) for s in values.spans]
    if runs > 1:
        body = ", ".join(listed[:-1]) + " and " + listed[-1]
    else:
        body = listed[0]
    return f"{count} {noun} in {runs} {run_noun}, {body}"
