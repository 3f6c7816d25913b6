import pytest

from tallybook import (
    allocate,
    format_amount,
    group_thousands,
    parse_amount,
    percent_of,
    round_div,
    split_evenly,
)


def test_round_div_exact_division_ignores_mode():
    assert round_div(10, 5) == 2
    assert round_div(10, 5, "up") == 2, "nothing to round up"
    assert round_div(0, 3, "up") == 0
    assert round_div(7, 1) == 7


def test_round_div_half_even_ties():
    assert round_div(5, 2) == 2, "2.5 rounds to the even 2"
    assert round_div(7, 2) == 4, "3.5 rounds to the even 4"
    assert round_div(-5, 2) == -2


def test_round_div_half_even_non_ties():
    assert round_div(26, 10) == 3
    assert round_div(24, 10) == 2
    assert round_div(-26, 10) == -3


def test_round_div_half_up():
    assert round_div(5, 2, "half_up") == 3
    assert round_div(-5, 2, "half_up") == -3, "ties go away from zero"
    assert round_div(24, 10, "half_up") == 2
    assert round_div(26, 10, "half_up") == 3


def test_round_div_down_truncates_towards_zero():
    assert round_div(29, 10, "down") == 2
    assert round_div(-29, 10, "down") == -2


def test_round_div_up_goes_away_from_zero():
    assert round_div(21, 10, "up") == 3
    assert round_div(-21, 10, "up") == -3


def test_round_div_rejects_bad_arguments():
    with pytest.raises(ValueError):
        round_div(1, 0)
    with pytest.raises(ValueError):
        round_div(1, -2)
    with pytest.raises(ValueError):
        round_div(1, 2, "nearest")


def test_percent_of():
    assert percent_of(10000, 150) == 150, "1.5 % of 100.00"
    assert percent_of(333, 1500) == 50, "49.95 rounds to 50"
    assert percent_of(10, 2500) == 2, "2.5 rounds half-even"
    assert percent_of(10, 2500, "half_up") == 3


def test_parse_amount_plain():
    assert parse_amount("7") == 700
    assert parse_amount("0.05") == 5
    assert parse_amount(".5") == 50
    assert parse_amount(" 1,234.5 ") == 123450


def test_parse_amount_signs_and_symbol():
    assert parse_amount("-3.10") == -310
    assert parse_amount("(12.05)") == -1205, "accounting negative"
    assert parse_amount("$7.25") == 725
    assert parse_amount("-$7.25") == -725


def test_parse_amount_other_decimals():
    assert parse_amount("1.234", decimals=3) == 1234
    assert parse_amount("15", decimals=0) == 15
    with pytest.raises(ValueError):
        parse_amount("1.5", decimals=0)


def test_parse_amount_rejects_garbage():
    with pytest.raises(ValueError):
        parse_amount("1.234")
    for text in ("abc", "1.2x", "", ".", "+5", "1_000"):
        with pytest.raises(ValueError):
            parse_amount(text)


def test_group_thousands():
    assert group_thousands("1234567") == "1,234,567"
    assert group_thousands("1234") == "1,234"
    assert group_thousands("123") == "123"
    assert group_thousands("12") == "12"
    assert group_thousands("123456", " ") == "123 456"


def test_format_amount():
    assert format_amount(123456) == "1,234.56"
    assert format_amount(0) == "0.00"
    assert format_amount(-5) == "-0.05"


def test_format_amount_accounting_negative():
    assert format_amount(-123456, accounting=True) == "(1,234.56)"
    assert format_amount(123456, accounting=True) == "1,234.56"


def test_format_amount_decimals_and_separators():
    assert format_amount(1500, decimals=0) == "1,500"
    assert format_amount(15, decimals=1) == "1.5"
    assert format_amount(1234, decimals=3) == "1.234"
    assert format_amount(123456789, thousands=" ", point=",") == "1 234 567,89"


def test_split_evenly():
    assert split_evenly(10, 3) == [4, 3, 3]
    assert split_evenly(9, 3) == [3, 3, 3]
    assert split_evenly(2, 4) == [1, 1, 0, 0]
    assert split_evenly(5, 1) == [5]


def test_split_evenly_negative_total():
    assert split_evenly(-10, 3) == [-4, -3, -3]


def test_split_evenly_rejects_zero_parts():
    with pytest.raises(ValueError):
        split_evenly(10, 0)


def test_allocate_largest_remainder():
    assert allocate(100, [1, 2]) == [33, 67]
    assert allocate(10, [3, 3, 4]) == [3, 3, 4]
    assert allocate(7, [0, 1]) == [0, 7]


def test_allocate_ties_go_to_earliest():
    assert allocate(100, [1, 1, 1]) == [34, 33, 33]
    assert allocate(2, [1, 1, 1]) == [1, 1, 0]


def test_allocate_negative_total_still_sums():
    shares = allocate(-100, [1, 1, 1])
    assert shares == [-33, -33, -34]
    assert sum(shares) == -100


def test_allocate_rejects_bad_weights():
    with pytest.raises(ValueError):
        allocate(10, [2, -1])
    with pytest.raises(ValueError):
        allocate(10, [0, 0])
