"""Operations over lists of records: filter, sort, group, aggregate, page, project."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import cmp_to_key

from .evaluate import get_field, matches
from .parser import parse

Record = Mapping[str, object]
AGGREGATES = ("count", "sum", "min", "max", "avg")


def where(records: Iterable[Record], expression: str) -> list[Record]:
    """The records matching the filter ``expression``, in their original order."""
    node = parse(expression)
    return [r for r in records if matches(node, r)]


def parse_order(spec: str) -> list[tuple[str, bool]]:
    """``"age desc, name"`` -> ``[("age", True), ("name", False)]`` (field, descending)."""
    keys: list[tuple[str, bool]] = []
    for part in spec.split(","):
        words = part.split()
        if not words:
            continue
        if len(words) > 2:
            raise ValueError(f"bad sort key {part.strip()!r}")
        direction = words[1].lower() if len(words) == 2 else "asc"
        if direction not in ("asc", "desc"):
            raise ValueError(f"bad sort direction {direction!r}")
        keys.append((words[0], direction == "desc"))
    return keys


def _compare_values(left: object, right: object) -> int:
    """Order two field values: numbers, then text (ignoring case), then missing (``None``)."""
    if left is None or right is None:
        return (left is None) - (right is None)
    left_rank = 0 if isinstance(left, (int, float)) else 1
    right_rank = 0 if isinstance(right, (int, float)) else 1
    if left_rank != right_rank:
        return left_rank - right_rank
    if left_rank == 1:
        left, right = str(left).lower(), str(right).lower()
    if left < right:  # type: ignore[operator]
        return -1
    if left > right:  # type: ignore[operator]
        return 1
    return 0


def order_by(records: Iterable[Record], spec: str) -> list[Record]:
    """Records sorted by the keys of ``spec``; stable, missing values last in either direction."""
    keys = parse_order(spec)

    def compare(a: Record, b: Record) -> int:
        for field, descending in keys:
            x, y = get_field(a, field), get_field(b, field)
            result = _compare_values(x, y)
            if descending and x is not None and y is not None:
                result = -result
            if result != 0:
                return result
        return 0

    return sorted(records, key=cmp_to_key(compare))


def group_by(records: Iterable[Record], field: str) -> dict[object, list[Record]]:
    """Records grouped by the value of ``field``, groups in order of first appearance."""
    groups: dict[object, list[Record]] = {}
    for record in records:
        groups.setdefault(get_field(record, field), []).append(record)
    return groups


def aggregate(records: Sequence[Record], func: str, field: str | None = None) -> object:
    """``count``, ``sum``, ``min``, ``max`` or ``avg`` of a numeric field (``None``s skipped).

    ``count`` without a field counts records; ``min``/``max``/``avg`` of nothing are ``None``.
    """
    if func not in AGGREGATES:
        raise ValueError(f"unknown aggregate {func!r}")
    if field is None:
        if func == "count":
            return len(records)
        raise ValueError(f"{func} needs a field")
    values = [v for v in (get_field(r, field) for r in records) if v is not None]
    if func == "count":
        return len(values)
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(numbers) != len(values):
        raise TypeError(f"{func} of {field!r} needs numbers")
    if func == "sum":
        return sum(numbers)
    if not numbers:
        return None
    if func == "min":
        return min(numbers)
    if func == "max":
        return max(numbers)
    return sum(numbers) / len(numbers)


def summarize(
    records: Sequence[Record], by: str, func: str, field: str | None = None
) -> list[dict[str, object]]:
    """One row per group of ``by``: ``{by: key, func: value}``, groups sorted by key."""
    groups = group_by(records, by)
    rows = [{by: key, func: aggregate(members, func, field)} for key, members in groups.items()]
    return order_by(rows, by)  # type: ignore[return-value]


def paginate(records: Sequence[Record], page: int, per_page: int) -> list[Record]:
    """Page ``page`` (1-based) of ``per_page`` records; past the end is an empty page."""
    if page < 1 or per_page < 1:
        raise ValueError("page and per_page must be at least 1")
    start = (page - 1) * per_page
    return list(records[start : start + per_page])


def page_count(total: int, per_page: int) -> int:
    """How many pages ``total`` records fill; at least 1, so an empty result has one page."""
    if per_page < 1:
        raise ValueError("per_page must be at least 1")
    return max(1, (total + per_page - 1) // per_page)


def distinct(records: Iterable[Record], field: str) -> list[object]:
    """The distinct values of ``field``, in order of first appearance (``None`` skipped)."""
    seen: list[object] = []
    for record in records:
        value = get_field(record, field)
        if value is not None and value not in seen:
            seen.append(value)
    return seen


def select(records: Iterable[Record], fields: Sequence[str]) -> list[dict[str, object]]:
    """Project records onto ``fields``; ``"owner.name as owner"`` renames a column."""
    columns: list[tuple[str, str]] = []
    for spec in fields:
        path, sep, alias = spec.partition(" as ")
        columns.append((path.strip(), alias.strip() if sep else path.strip()))
    return [{alias: get_field(r, path) for path, alias in columns} for r in records]
