import pytest

from spanset import Span


def test_span_rejects_start_after_end():
    with pytest.raises(ValueError):
        Span(3, 2)
    assert Span(3, 3).length == 0, "an empty span is allowed"


def test_closed_includes_both_ends():
    span = Span.closed(3, 5)
    assert span == Span(3, 6)
    assert span.length == 3


def test_last_is_end_minus_one():
    assert Span(2, 5).last == 4
    with pytest.raises(ValueError):
        Span(2, 2).last


def test_is_empty():
    assert Span(4, 4).is_empty()
    assert not Span(4, 5).is_empty()


def test_contains_is_half_open():
    span = Span(2, 5)
    assert span.contains(2), "start is included"
    assert span.contains(4)
    assert not span.contains(5), "end is excluded"
    assert not span.contains(1)


def test_covers():
    outer = Span(2, 8)
    assert outer.covers(Span(2, 8)), "a span covers itself"
    assert outer.covers(Span(3, 5))
    assert not outer.covers(Span(1, 5)), "sticks out on the left"
    assert not outer.covers(Span(5, 9)), "sticks out on the right"


def test_covers_empty_span_anywhere():
    assert Span(2, 3).covers(Span(10, 10))


def test_overlaps():
    assert Span(0, 5).overlaps(Span(4, 8))
    assert Span(4, 8).overlaps(Span(0, 5))
    assert not Span(0, 5).overlaps(Span(5, 8)), "adjacent spans share nothing"
    assert not Span(5, 8).overlaps(Span(0, 5))


def test_touches_includes_adjacent():
    assert Span(0, 5).touches(Span(5, 8))
    assert Span(5, 8).touches(Span(0, 5))
    assert not Span(0, 5).touches(Span(6, 8)), "a one-integer gap"
    assert not Span(6, 8).touches(Span(0, 5))


def test_intersection():
    assert Span(0, 5).intersection(Span(3, 9)) == Span(3, 5)
    assert Span(0, 10).intersection(Span(2, 4)) == Span(2, 4)
    assert Span(0, 5).intersection(Span(5, 9)) is None


def test_hull():
    assert Span(0, 2).hull(Span(5, 9)) == Span(0, 9)
    assert Span(5, 9).hull(Span(0, 2)) == Span(0, 9)


def test_split_at_inside():
    assert Span(2, 8).split_at(5) == (Span(2, 5), Span(5, 8))


def test_split_at_clamps_outside_values():
    assert Span(2, 8).split_at(0) == (Span(2, 2), Span(2, 8))
    assert Span(2, 8).split_at(20) == (Span(2, 8), Span(8, 8))


def test_shift():
    assert Span(2, 5).shift(3) == Span(5, 8)
    assert Span(2, 5).shift(-2) == Span(0, 3)


def test_distance():
    assert Span(0, 3).distance(Span(5, 9)) == 2
    assert Span(5, 9).distance(Span(0, 3)) == 2, "distance is symmetric"
    assert Span(0, 3).distance(Span(3, 5)) == 0
    assert Span(0, 6).distance(Span(3, 5)) == 0
