"""Splitting a filter expression into tokens."""

from __future__ import annotations

import re
from dataclasses import dataclass

KEYWORDS = frozenset({"and", "or", "not", "in", "true", "false", "null"})

_TOKEN_RE = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<number>-?\d+(?:\.\d+)?)
  | (?P<string>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
  | (?P<op>!=|<=|>=|=|<|>|~)
  | (?P<punct>[()\[\],])
    """,
    re.VERBOSE,
)

_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\", "'": "'", '"': '"'}


class QuerySyntaxError(ValueError):
    """A filter expression that cannot be read; ``pos`` is the offending offset."""

    def __init__(self, message: str, pos: int) -> None:
        super().__init__(f"{message} at position {pos}")
        self.pos = pos


@dataclass(frozen=True)
class Token:
    """``kind`` is one of number, string, name, keyword, op, punct or end."""

    kind: str
    value: object
    pos: int


def decode_string(raw: str) -> str:
    """The text of a quoted string literal, with its quotes removed and escapes applied."""
    body = raw[1:-1]
    out: list[str] = []
    escaped = False
    for char in body:
        if escaped:
            out.append(_ESCAPES.get(char, "\\" + char))
            escaped = False
        elif char == "\\":
            escaped = True
        else:
            out.append(char)
    return "".join(out)


def _number(text: str) -> int | float:
    return float(text) if "." in text else int(text)


def tokenize(text: str) -> list[Token]:
    """The tokens of ``text``, ending with an ``end`` token; raises ``QuerySyntaxError``."""
    tokens: list[Token] = []
    pos = 0
    for match in _TOKEN_RE.finditer(text):
        if match.start() != pos:
            raise QuerySyntaxError(f"unexpected character {text[pos]!r}", pos)
        pos = match.end()
        kind = match.lastgroup or ""
        lexeme = match.group()
        if kind == "space":
            continue
        if kind == "number":
            tokens.append(Token("number", _number(lexeme), match.start()))
        elif kind == "string":
            tokens.append(Token("string", decode_string(lexeme), match.start()))
        elif kind == "name" and lexeme.lower() in KEYWORDS:
            tokens.append(Token("keyword", lexeme.lower(), match.start()))
        else:
            tokens.append(Token(kind, lexeme, match.start()))
    if pos != len(text):
        raise QuerySyntaxError(f"unexpected character {text[pos]!r}", pos)
    tokens.append(Token("end", None, len(text)))
    return tokens
