import pytest

from recq import (
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

PEOPLE = [
    {"name": "Alice", "age": 34, "team": "core", "owner": {"name": "Zed"}},
    {"name": "bob", "age": 27, "team": "web"},
    {"name": "Carol", "age": 41, "team": "core"},
    {"name": "Dave", "age": None, "team": "web"},
    {"name": "Erin", "age": 27, "team": "ops"},
]


def names(records):
    return [r["name"] for r in records]


def test_where_filters_in_order():
    assert names(where(PEOPLE, "age >= 30")) == ["Alice", "Carol"]
    assert names(where(PEOPLE, "team = 'web' or name ~ 'ER'")) == ["bob", "Dave", "Erin"]


def test_where_nested_and_null():
    assert names(where(PEOPLE, "owner.name = 'Zed'")) == ["Alice"]
    assert names(where(PEOPLE, "age = null")) == ["Dave"]


def test_parse_order():
    assert parse_order("age desc, name") == [("age", True), ("name", False)]
    assert parse_order("team ASC,,age") == [("team", False), ("age", False)]


def test_parse_order_rejects_bad_keys():
    with pytest.raises(ValueError):
        parse_order("age down")
    with pytest.raises(ValueError):
        parse_order("age desc now")


def test_order_by_ascending_is_stable():
    assert names(order_by(PEOPLE, "age")) == ["bob", "Erin", "Alice", "Carol", "Dave"]


def test_order_by_descending_keeps_missing_last():
    assert names(order_by(PEOPLE, "age desc")) == ["Carol", "Alice", "bob", "Erin", "Dave"]


def test_order_by_text_ignores_case():
    assert names(order_by(PEOPLE, "name desc")) == ["Erin", "Dave", "Carol", "bob", "Alice"]


def test_order_by_missing_text_sorts_last():
    rows = [{"n": "zed"}, {}, {"n": "Amy"}]
    assert order_by(rows, "n") == [{"n": "Amy"}, {"n": "zed"}, {}]
    assert order_by(rows, "n desc") == [{"n": "zed"}, {"n": "Amy"}, {}]


def test_order_by_several_keys():
    assert names(order_by(PEOPLE, "team, age desc")) == ["Carol", "Alice", "Erin", "bob", "Dave"]


def test_order_by_numbers_before_text():
    rows = [{"v": "b"}, {"v": 10}, {"v": "a"}, {"v": 2}]
    assert [r["v"] for r in order_by(rows, "v")] == [2, 10, "a", "b"]


def test_group_by_keeps_first_appearance_order():
    groups = group_by(PEOPLE, "team")
    assert list(groups) == ["core", "web", "ops"]
    assert names(groups["web"]) == ["bob", "Dave"]


def test_aggregate_count():
    assert aggregate(PEOPLE, "count") == 5
    assert aggregate(PEOPLE, "count", "age") == 4, "None values are not counted"


def test_aggregate_sum_min_max_avg():
    assert aggregate(PEOPLE, "sum", "age") == 129
    assert aggregate(PEOPLE, "min", "age") == 27
    assert aggregate(PEOPLE, "max", "age") == 41
    assert aggregate(PEOPLE, "avg", "age") == 32.25


def test_aggregate_of_nothing():
    assert aggregate([], "sum", "age") == 0
    assert aggregate([], "avg", "age") is None
    assert aggregate([{"age": None}], "max", "age") is None


def test_aggregate_errors():
    with pytest.raises(ValueError):
        aggregate(PEOPLE, "median", "age")
    with pytest.raises(ValueError):
        aggregate(PEOPLE, "sum")
    with pytest.raises(TypeError):
        aggregate(PEOPLE, "sum", "name")


def test_summarize_groups_sorted_by_key():
    rows = summarize(PEOPLE, "team", "sum", "age")
    assert rows == [
        {"team": "core", "sum": 75},
        {"team": "ops", "sum": 27},
        {"team": "web", "sum": 27},
    ]


def test_paginate():
    assert names(paginate(PEOPLE, 1, 2)) == ["Alice", "bob"]
    assert names(paginate(PEOPLE, 3, 2)) == ["Erin"], "a short last page"
    assert paginate(PEOPLE, 4, 2) == []
    assert names(paginate(PEOPLE, 2, 1)) == ["bob"]


def test_paginate_rejects_bad_numbers():
    with pytest.raises(ValueError):
        paginate(PEOPLE, 0, 2)
    with pytest.raises(ValueError):
        paginate(PEOPLE, 1, 0)


def test_page_count():
    assert page_count(0, 10) == 1
    assert page_count(10, 10) == 1
    assert page_count(11, 10) == 2
    assert page_count(5, 1) == 5
    with pytest.raises(ValueError):
        page_count(5, 0)


def test_distinct():
    assert distinct(PEOPLE, "age") == [34, 27, 41]
    assert distinct(PEOPLE, "team") == ["core", "web", "ops"]


def test_select_with_alias():
    rows = select(PEOPLE[:2], ["name", "owner.name as owner"])
    assert rows == [{"name": "Alice", "owner": "Zed"}, {"name": "bob", "owner": None}]


def test_query_pipeline():
    found = where(PEOPLE, "not team = 'ops' and age != null")
    page = paginate(order_by(found, "age desc"), 1, 2)
    assert select(page, ["name", "age as years"]) == [
        {"name": "Carol", "years": 41},
        {"name": "Alice", "years": 34},
    ]
