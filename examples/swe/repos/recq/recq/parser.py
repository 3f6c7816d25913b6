"""Parsing filter expressions into a small tree of nodes.

Grammar (keywords are case-insensitive)::

    expr    := conj ("or" conj)*
    conj    := unary ("and" unary)*
    unary   := "not" unary | primary
    primary := "(" expr ")" | NAME OP literal | NAME ["not"] "in" "[" literal ("," literal)* "]"
    literal := NUMBER | STRING | "true" | "false" | "null"
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

from .lexer import QuerySyntaxError, Token, tokenize

COMPARISONS = ("=", "!=", "<", "<=", ">", ">=", "~")
MAX_DEPTH = 16


@dataclass(frozen=True)
class Compare:
    """``field op value``; ``field`` may be a dotted path into nested records."""

    field: str
    op: str
    value: object


@dataclass(frozen=True)
class Member:
    """``field in [values]``, or ``field not in [values]`` when ``negated``."""

    field: str
    values: tuple[object, ...]
    negated: bool = False


@dataclass(frozen=True)
class Not:
    operand: Node


@dataclass(frozen=True)
class And:
    operands: tuple[Node, ...]


@dataclass(frozen=True)
class Or:
    operands: tuple[Node, ...]


Node = Union[Compare, Member, Not, And, Or]

_LITERAL_KEYWORDS: dict[str, object] = {"true": True, "false": False, "null": None}


class _Parser:
    def __init__(self, tokens: list[Token]) -> None:
        self.tokens = tokens
        self.index = 0
        self.depth = 0

    def peek(self) -> Token:
        return self.tokens[self.index]

    def advance(self) -> Token:
        token = self.tokens[self.index]
        if token.kind != "end":
            self.index += 1
        return token

    def accept(self, kind: str, value: object) -> bool:
        token = self.peek()
        if token.kind == kind and token.value == value:
            self.advance()
            return True
        return False

    def expect(self, kind: str, value: object) -> None:
        if not self.accept(kind, value):
            token = self.peek()
            raise QuerySyntaxError(f"expected {value!r}, found {token.value!r}", token.pos)

    def chain(self, keyword: str, parse_operand: Callable[[], Node]) -> Node:
        operands = [parse_operand()]
        for _ in range(len(self.tokens)):
            if not self.accept("keyword", keyword):
                break
            operands.append(parse_operand())
        if len(operands) == 1:
            return operands[0]
        return Or(tuple(operands)) if keyword == "or" else And(tuple(operands))

    def expr(self) -> Node:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise QuerySyntaxError("expression nested too deeply", self.peek().pos)
        node = self.chain("or", self.conj)
        self.depth -= 1
        return node

    def conj(self) -> Node:
        return self.chain("and", self.unary)

    def unary(self) -> Node:
        if self.accept("keyword", "not"):
            return Not(self.unary())
        return self.primary()

    def primary(self) -> Node:
        if self.accept("punct", "("):
            node = self.expr()
            self.expect("punct", ")")
            return node
        token = self.advance()
        if token.kind != "name":
            raise QuerySyntaxError(f"expected a field name, found {token.value!r}", token.pos)
        field = str(token.value)
        negated = self.accept("keyword", "not")
        if self.accept("keyword", "in"):
            return Member(field, self.literal_list(), negated)
        if negated:
            raise QuerySyntaxError("expected 'in' after 'not'", self.peek().pos)
        op = self.advance()
        if op.kind != "op" or op.value not in COMPARISONS:
            raise QuerySyntaxError(f"expected a comparison, found {op.value!r}", op.pos)
        return Compare(field, str(op.value), self.literal())

    def literal_list(self) -> tuple[object, ...]:
        self.expect("punct", "[")
        values = [self.literal()]
        for _ in range(len(self.tokens)):
            if not self.accept("punct", ","):
                break
            values.append(self.literal())
        self.expect("punct", "]")
        return tuple(values)

    def literal(self) -> object:
        token = self.advance()
        if token.kind in ("number", "string"):
            return token.value
        if token.kind == "keyword" and token.value in _LITERAL_KEYWORDS:
            return _LITERAL_KEYWORDS[str(token.value)]
        raise QuerySyntaxError(f"expected a value, found {token.value!r}", token.pos)


def parse(text: str) -> Node:
    """Parse a filter expression; raises ``QuerySyntaxError`` on malformed input."""
    parser = _Parser(tokenize(text))
    node = parser.expr()
    trailing = parser.peek()
    if trailing.kind != "end":
        raise QuerySyntaxError(f"unexpected {trailing.value!r}", trailing.pos)
    return node
