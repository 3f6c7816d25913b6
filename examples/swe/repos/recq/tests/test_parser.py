import pytest

from recq import And, Compare, Member, Not, Or, QuerySyntaxError, parse


def test_parse_comparison():
    assert parse("age >= 30") == Compare("age", ">=", 30)
    assert parse("owner.name ~ 'al'") == Compare("owner.name", "~", "al")


def test_parse_keyword_literals():
    assert parse("done = true") == Compare("done", "=", True)
    assert parse("done = false") == Compare("done", "=", False)
    assert parse("due = null") == Compare("due", "=", None)


def test_parse_and_chain_is_flat():
    assert parse("a = 1 and b = 2 and c = 3") == And(
        (Compare("a", "=", 1), Compare("b", "=", 2), Compare("c", "=", 3))
    )


def test_parse_or_chain_is_flat():
    assert parse("a = 1 or b = 2 or c = 3") == Or(
        (Compare("a", "=", 1), Compare("b", "=", 2), Compare("c", "=", 3))
    )


def test_parse_and_binds_tighter_than_or():
    assert parse("a = 1 or b = 2 and c = 3") == Or(
        (Compare("a", "=", 1), And((Compare("b", "=", 2), Compare("c", "=", 3))))
    )


def test_parse_parentheses_group():
    assert parse("(a = 1 or b = 2) and c = 3") == And(
        (Or((Compare("a", "=", 1), Compare("b", "=", 2))), Compare("c", "=", 3))
    )


def test_parse_not():
    assert parse("not a = 1") == Not(Compare("a", "=", 1))
    assert parse("not not a = 1") == Not(Not(Compare("a", "=", 1)))


def test_parse_membership():
    assert parse("x in [1, 'two', null]") == Member("x", (1, "two", None))
    assert parse("x in [5]") == Member("x", (5,))


def test_parse_negated_membership():
    assert parse("x not in [1, 2]") == Member("x", (1, 2), negated=True)


def test_parse_missing_pieces():
    for text in ("a = ", "a 1", "= 1", "(a = 1", "", "a not = 1", "5 = 5", "'a' = 1", "a b 1"):
        with pytest.raises(QuerySyntaxError):
            parse(text)


def test_parse_bad_lists():
    for text in ("x in []", "x in [1, 2", "x in 1", "x in [1 2]"):
        with pytest.raises(QuerySyntaxError):
            parse(text)


def test_parse_trailing_tokens_reported_with_position():
    with pytest.raises(QuerySyntaxError) as info:
        parse("a = 1 )")
    assert info.value.pos == 6
    with pytest.raises(QuerySyntaxError):
        parse("a = 1 b = 2")


def test_parse_nesting_limit():
    ok = "(" * 15 + "a = 1" + ")" * 15
    assert parse(ok) == Compare("a", "=", 1)
    too_deep = "(" * 16 + "a = 1" + ")" * 16
    with pytest.raises(QuerySyntaxError):
        parse(too_deep)


def test_parse_nesting_limit_after_a_group():
    text = "(a = 1) or " + "(" * 16 + "b = 1" + ")" * 16
    with pytest.raises(QuerySyntaxError):
        parse(text)


def test_parse_many_sibling_groups_are_not_nesting():
    text = " or ".join(f"(f{i} = {i})" for i in range(40))
    node = parse(text)
    assert isinstance(node, Or) and len(node.operands) == 40
