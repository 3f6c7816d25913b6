"""Evaluating parsed filters against records (dictionaries, possibly nested)."""

from __future__ import annotations

from collections.abc import Mapping

from .parser import And, Compare, Member, Node, Not, Or

MISSING = object()


def get_field(record: Mapping[str, object], path: str, default: object = None) -> object:
    """The value at a dotted ``path`` such as ``"owner.name"``, or ``default`` if absent."""
    current: object = record
    for part in path.split("."):
        if not isinstance(current, Mapping) or part not in current:
            return default
        current = current[part]
    return current


def _comparable(left: object, right: object) -> bool:
    """True when ``left`` and ``right`` may be ordered against each other."""
    numeric = (int, float)
    if isinstance(left, bool) or isinstance(right, bool):
        return isinstance(left, bool) and isinstance(right, bool)
    if isinstance(left, numeric) and isinstance(right, numeric):
        return True
    return isinstance(left, str) and isinstance(right, str)


def compare(left: object, op: str, right: object) -> bool:
    """Apply a comparison operator; values of different kinds are never ordered.

    ``=`` and ``!=`` work on any values; ``~`` is a case-insensitive substring test on
    strings; a missing field (``MISSING``) only satisfies ``!=``.
    """
    if op == "=":
        return left == right
    if op == "!=":
        return left != right
    if op == "~":
        return isinstance(left, str) and isinstance(right, str) and right.lower() in left.lower()
    if not _comparable(left, right):
        return False
    if op == "<":
        return bool(left < right)  # type: ignore[operator]
    if op == "<=":
        return bool(left <= right)  # type: ignore[operator]
    if op == ">":
        return bool(left > right)  # type: ignore[operator]
    if op == ">=":
        return bool(left >= right)  # type: ignore[operator]
    raise ValueError(f"unknown operator {op!r}")


def matches(node: Node, record: Mapping[str, object]) -> bool:
    """True when ``record`` satisfies the filter ``node``."""
    if isinstance(node, Compare):
        return compare(get_field(record, node.field, MISSING), node.op, node.value)
    if isinstance(node, Member):
        value = get_field(record, node.field, MISSING)
        found = value is not MISSING and value in node.values
        return found != node.negated
    if isinstance(node, Not):
        return not matches(node.operand, record)
    if isinstance(node, And):
        return all(matches(child, record) for child in node.operands)
    if isinstance(node, Or):
        return any(matches(child, record) for child in node.operands)
    raise TypeError(f"not a filter node: {node!r}")


def fields_used(node: Node) -> list[str]:
    """The field paths a filter reads, in first-use order, without repeats."""
    seen: list[str] = []
    stack = [node]
    for _ in range(10_000):
        if not stack:
            break
        current = stack.pop()
        if isinstance(current, (Compare, Member)):
            if current.field not in seen:
                seen.append(current.field)
        elif isinstance(current, Not):
            stack.append(current.operand)
        else:
            stack.extend(reversed(current.operands))
    return seen
