import pytest

from spanset import (
    Span,
    SpanSet,
    format_ranges,
    from_mask,
    parse_item,
    parse_ranges,
    summarize,
    to_mask,
)


def test_parse_item_single_and_closed_range():
    assert parse_item("7", 0, None) == Span(7, 8)
    assert parse_item(" 3-9 ", 0, None) == Span(3, 10)
    assert parse_item("4-4", 0, None) == Span(4, 5)
    assert parse_item("3 - 9", 0, None) == Span(3, 10), "spaces around the dash"


def test_parse_item_open_ends():
    assert parse_item("5-", 0, 8) == Span(5, 9)
    assert parse_item("-4", 1, None) == Span(1, 5)
    with pytest.raises(ValueError):
        parse_item("5-", 0, None)


def test_parse_item_rejects_backwards_and_garbage():
    with pytest.raises(ValueError):
        parse_item("9-3", 0, None)
    with pytest.raises(ValueError):
        parse_item("4-3", 0, None)
    with pytest.raises(ValueError):
        parse_item("+5", 0, None)
    with pytest.raises(ValueError):
        parse_item("x", 0, None)
    with pytest.raises(ValueError):
        parse_item("2-y", 0, None)


def test_parse_ranges_list():
    values = parse_ranges("1-3, 7, 9-12")
    assert values.spans == (Span(1, 4), Span(7, 8), Span(9, 13))
    assert parse_ranges("0,2") == SpanSet.of(0, 2), "0 is allowed by default"


def test_parse_ranges_skips_empty_items():
    assert parse_ranges("1,,3,") == SpanSet.of(1, 3)
    assert not parse_ranges("")


def test_parse_ranges_lower_limit():
    assert parse_ranges("1-2", lower=1) == SpanSet.of(1, 2)
    with pytest.raises(ValueError):
        parse_ranges("0-2", lower=1)


def test_parse_ranges_upper_limit():
    assert parse_ranges("5-9", upper=9) == SpanSet([Span(5, 10)])
    with pytest.raises(ValueError):
        parse_ranges("5-10", upper=9)


def test_parse_ranges_open_end_uses_upper():
    assert parse_ranges("3,8-", lower=1, upper=10) == SpanSet.of(3, 8, 9, 10)


def test_format_ranges_default():
    values = SpanSet.of(1, 2, 3, 7, 9, 10)
    assert format_ranges(values) == "1-3,7,9-10"


def test_format_ranges_min_run():
    values = SpanSet.of(1, 2, 3, 7, 9, 10)
    assert format_ranges(values, min_run=3) == "1-3,7,9,10"
    assert format_ranges(values, min_run=1) == "1-3,7,9-10", "a single value is never a range"


def test_format_ranges_separator_and_empty():
    assert format_ranges(SpanSet.of(1, 4), sep="; ") == "1; 4"
    assert format_ranges(SpanSet()) == ""


def test_from_mask():
    assert from_mask("..##.#") == SpanSet.of(2, 3, 5)
    assert from_mask("##..") == SpanSet.of(0, 1), "a run at the start"
    assert from_mask("....") == SpanSet()


def test_from_mask_offset_and_mark():
    assert from_mask("x.xx", offset=10, mark="x") == SpanSet.of(10, 12, 13)


def test_to_mask():
    values = SpanSet.of(2, 3, 5)
    assert to_mask(values, Span(0, 6)) == "..##.#"
    assert to_mask(values, Span(3, 7), mark="1", blank="0") == "1010"


def test_summarize():
    assert summarize(SpanSet()) == "no values"
    assert summarize(SpanSet.of(4)) == "1 value in 1 run, 4"
    assert summarize(SpanSet.of(1, 2, 3, 4, 5, 9, 10)) == "7 values in 2 runs, 1-5 and 9-10"
    assert summarize(SpanSet.of(1, 3, 5)) == "3 values in 3 runs, 1, 3 and 5"


def test_pages_left_to_print():
    wanted = parse_ranges("1-20", lower=1, upper=20)
    printed = parse_ranges("1-4, 9, 15-", lower=1, upper=20)
    assert format_ranges(wanted.difference(printed)) == "5-8,10-14"


def test_mask_round_trip():
    mask = "#..###.#.."
    values = from_mask(mask)
    assert to_mask(values, Span(0, len(mask))) == mask
    assert format_ranges(values) == "0,3-5,7"
