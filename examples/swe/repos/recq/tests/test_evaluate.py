import pytest

from recq import And, Compare, Member, Not, Or, compare, fields_used, get_field, matches
from recq.evaluate import MISSING

RECORD = {"name": "Alice", "age": 34, "owner": {"name": "Zed", "level": 2}, "done": False}


def test_get_field_nested_and_missing():
    assert get_field(RECORD, "name") == "Alice"
    assert get_field(RECORD, "owner.level") == 2
    assert get_field(RECORD, "owner.email") is None
    assert get_field(RECORD, "name.first", "n/a") == "n/a", "a string has no fields"


def test_compare_equality():
    assert compare(3, "=", 3)
    assert not compare(3, "=", 4)
    assert compare(3, "!=", 4)
    assert not compare("a", "!=", "a")
    assert compare(None, "=", None)


def test_compare_less_than_family():
    assert compare(2, "<", 3) and not compare(3, "<", 3)
    assert compare(3, "<=", 3) and not compare(4, "<=", 3)


def test_compare_greater_than_family():
    assert compare(4, ">", 3) and not compare(3, ">", 3)
    assert compare(3, ">=", 3) and not compare(2, ">=", 3)


def test_compare_strings_order():
    assert compare("apple", "<", "banana")
    assert compare(2.5, ">", 2), "int and float are comparable"


def test_compare_mixed_kinds_never_order():
    assert not compare("10", ">", 5)
    assert not compare(5, "<", "10")
    assert not compare(None, "<", 3)
    assert not compare(True, ">", 0), "booleans are not numbers here"
    assert compare(True, ">", False)


def test_compare_contains_is_case_insensitive():
    assert compare("Alice", "~", "LI")
    assert not compare("Alice", "~", "bob")
    assert not compare(123, "~", "2"), "only strings contain text"


def test_compare_missing_only_satisfies_not_equal():
    assert compare(MISSING, "!=", 1)
    assert not compare(MISSING, "=", None)
    assert not compare(MISSING, "<", 1)


def test_compare_unknown_operator():
    with pytest.raises(ValueError):
        compare(1, "<>", 2)


def test_matches_compare_on_nested_field():
    assert matches(Compare("owner.name", "=", "Zed"), RECORD)
    assert not matches(Compare("owner.name", "=", "Amy"), RECORD)
    assert matches(Compare("email", "!=", "x@y"), RECORD), "missing field differs from anything"


def test_matches_membership():
    assert matches(Member("age", (30, 34)), RECORD)
    assert not matches(Member("age", (30, 31)), RECORD)
    assert matches(Member("age", (30, 31), negated=True), RECORD)
    assert not matches(Member("email", (None,)), RECORD), "missing is not null"
    assert matches(Member("email", (None,), negated=True), RECORD)


def test_matches_boolean_nodes():
    yes, no = Compare("age", "=", 34), Compare("age", "=", 1)
    assert matches(And((yes, yes)), RECORD) and not matches(And((yes, no)), RECORD)
    assert matches(Or((no, yes)), RECORD) and not matches(Or((no, no)), RECORD)
    assert matches(Not(no), RECORD) and not matches(Not(yes), RECORD)


def test_matches_rejects_other_objects():
    with pytest.raises(TypeError):
        matches("age = 1", RECORD)


def test_fields_used_in_first_use_order():
    node = And((
        Compare("b", "=", 1),
        Or((Member("a", (1,)), Not(Compare("b", ">", 2)))),
        Compare("c.d", "~", "x"),
    ))
    assert fields_used(node) == ["b", "a", "c.d"]
