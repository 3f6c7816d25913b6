"""recq: a small filter-expression language and query operations over lists of records."""

from .evaluate import compare, fields_used, get_field, matches
from .lexer import QuerySyntaxError, Token, decode_string, tokenize
from .ops import (
    aggregate,
    distinct,
    group_by,
    order_by,
    page_count,
    paginate,
    parse_order,
    select,
    summarize,
    where,
)
from .parser import And, Compare, Member, Not, Or, parse

__all__ = [
    "And",
    "Compare",
    "Member",
    "Not",
    "Or",
    "QuerySyntaxError",
    "Token",
    "aggregate",
    "compare",
    "decode_string",
    "distinct",
    "fields_used",
    "get_field",
    "group_by",
    "matches",
    "order_by",
    "page_count",
    "paginate",
    "parse",
    "parse_order",
    "select",
    "summarize",
    "tokenize",
    "where",
]
