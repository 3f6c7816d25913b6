import pytest

from spanset import Span, SpanSet, normalize


def test_normalize_sorts_merges_and_drops_empty():
    spans = [Span(5, 7), Span(0, 2), Span(2, 3), Span(6, 9), Span(4, 4)]
    assert normalize(spans) == [Span(0, 3), Span(5, 9)]


def test_normalize_keeps_separated_spans_apart():
    assert normalize([Span(3, 4), Span(0, 2)]) == [Span(0, 2), Span(3, 4)]


def test_normalize_nested_span_keeps_outer_end():
    assert normalize([Span(0, 10), Span(2, 3)]) == [Span(0, 10)]


def test_of_builds_runs():
    assert SpanSet.of(3, 1, 2, 7).spans == (Span(1, 4), Span(7, 8))


def test_len_iter_bool():
    values = SpanSet([Span(0, 3), Span(10, 12)])
    assert len(values) == 5
    assert list(values) == [0, 1, 2, 10, 11]
    assert values
    assert not SpanSet()


def test_membership():
    values = SpanSet([Span(2, 5), Span(8, 10)])
    assert 2 in values and 4 in values and 8 in values and 9 in values
    assert 1 not in values, "below the first span"
    assert 5 not in values, "span end is excluded"
    assert 6 not in values, "in the gap"
    assert 10 not in values, "past the last span"
    assert "3" not in values, "only integers are members"


def test_empty_set_has_no_members():
    assert 3 not in SpanSet()


def test_equality_and_hash_follow_contents():
    a = SpanSet([Span(0, 2), Span(2, 4)])
    b = SpanSet([Span(0, 4)])
    assert a == b
    assert hash(a) == hash(b)
    assert a != SpanSet([Span(0, 3)])
    assert a != [Span(0, 4)], "a list of spans is not a SpanSet"


def test_repr():
    assert repr(SpanSet([Span(1, 3), Span(5, 6)])) == "SpanSet([1, 3), [5, 6))"


def test_bounds():
    assert SpanSet().bounds() is None
    assert SpanSet([Span(4, 6), Span(10, 12)]).bounds() == Span(4, 12)


def test_union_merges_touching_spans():
    merged = SpanSet([Span(0, 3)]).union(SpanSet([Span(3, 5), Span(8, 9)]))
    assert merged.spans == (Span(0, 5), Span(8, 9))


def test_intersection_sweeps_both_lists():
    left = SpanSet([Span(0, 5), Span(8, 12)])
    right = SpanSet([Span(3, 9), Span(11, 20)])
    assert left.intersection(right).spans == (Span(3, 5), Span(8, 9), Span(11, 12))


def test_intersection_with_disjoint_set_is_empty():
    assert not SpanSet([Span(0, 3)]).intersection(SpanSet([Span(3, 6)]))


def test_intersection_one_long_span_against_many():
    long = SpanSet([Span(0, 100)])
    many = SpanSet([Span(1, 2), Span(5, 7), Span(50, 60)])
    assert long.intersection(many) == many
    assert many.intersection(long) == many


def test_difference_punches_holes():
    base = SpanSet([Span(0, 10)])
    holes = SpanSet([Span(2, 4), Span(6, 7)])
    assert base.difference(holes).spans == (Span(0, 2), Span(4, 6), Span(7, 10))


def test_difference_at_the_edges():
    base = SpanSet([Span(0, 10)])
    assert base.difference(SpanSet([Span(0, 3)])).spans == (Span(3, 10),)
    assert base.difference(SpanSet([Span(8, 12)])).spans == (Span(0, 8),)
    assert not base.difference(SpanSet([Span(-5, 15)]))


def test_difference_over_several_spans():
    base = SpanSet([Span(0, 3), Span(10, 15)])
    holes = SpanSet([Span(1, 2), Span(12, 20)])
    assert base.difference(holes).spans == (Span(0, 1), Span(2, 3), Span(10, 12))


def test_gaps():
    values = SpanSet([Span(0, 2), Span(5, 6), Span(9, 12)])
    assert values.gaps() == [Span(2, 5), Span(6, 9)]
    assert SpanSet([Span(0, 2)]).gaps() == []


def test_complement_within_bounds():
    values = SpanSet([Span(2, 4), Span(6, 8)])
    assert values.complement(Span(0, 10)).spans == (Span(0, 2), Span(4, 6), Span(8, 10))


def test_clip():
    values = SpanSet([Span(0, 5), Span(8, 12)])
    assert values.clip(Span(3, 10)).spans == (Span(3, 5), Span(8, 10))


def test_nth_counts_across_spans():
    values = SpanSet([Span(10, 13), Span(20, 22)])
    assert values.nth(0) == 10
    assert values.nth(2) == 12
    assert values.nth(3) == 20, "first element of the second span"
    assert values.nth(4) == 21


def test_nth_negative_and_out_of_range():
    values = SpanSet([Span(10, 13), Span(20, 22)])
    assert values.nth(-1) == 21
    assert values.nth(-5) == 10
    with pytest.raises(IndexError):
        values.nth(5)
    with pytest.raises(IndexError):
        values.nth(-6)


def test_take_by_rank():
    values = SpanSet([Span(0, 4), Span(10, 14)])
    assert values.take(2, 6).spans == (Span(2, 4), Span(10, 12))
    assert values.take(4, 5).spans == (Span(10, 11),)
    assert values.take(-3, 1).spans == (Span(0, 1),)
    assert not values.take(3, 3)


def test_chunks():
    values = SpanSet([Span(0, 3), Span(10, 14)])
    pieces = values.chunks(3)
    assert [list(p) for p in pieces] == [[0, 1, 2], [10, 11, 12], [13]]


def test_chunks_rejects_zero_size():
    with pytest.raises(ValueError):
        SpanSet([Span(0, 3)]).chunks(0)
    with pytest.raises(ValueError):
        SpanSet([Span(0, 3)]).chunks(-2)
    assert len(SpanSet([Span(0, 3)]).chunks(1)) == 3


def test_largest_gap_prefers_first_on_ties():
    values = SpanSet([Span(0, 1), Span(3, 4), Span(6, 7), Span(12, 13)])
    assert values.largest_gap() == Span(7, 12)
    tied = SpanSet([Span(0, 1), Span(3, 4), Span(6, 7)])
    assert tied.largest_gap() == Span(1, 3)
    assert SpanSet([Span(0, 5)]).largest_gap() is None
