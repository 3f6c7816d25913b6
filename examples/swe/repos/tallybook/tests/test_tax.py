import pytest

from tallybook import (
    TaxRate,
    bracket_tax,
    effective_rate,
    format_rate,
    tax_for,
    tax_in_gross,
    tax_on_net,
    taxes_by_code,
)

BRACKETS = [(1_000_000, 0), (4_000_000, 2000), (None, 4000)]


def test_tax_rate_must_not_be_negative():
    with pytest.raises(ValueError):
        TaxRate("bad", -1)
    assert TaxRate("zero", 0).basis_points == 0


def test_format_rate():
    assert format_rate(2000) == "20%"
    assert format_rate(550) == "5.5%"
    assert format_rate(725) == "7.25%"
    assert format_rate(5) == "0.05%"
    assert format_rate(0) == "0%"


def test_tax_on_net():
    assert tax_on_net(1000, 2000) == 200
    assert tax_on_net(1234, 2000) == 247, "246.8 rounds up"


def test_tax_in_gross():
    assert tax_in_gross(1200, 2000) == 200
    assert tax_in_gross(1000, 2000) == 167, "net 833.33 rounds to 833"
    assert tax_in_gross(105, 500) == 5


def test_tax_for_dispatches_on_inclusive():
    assert tax_for(1200, TaxRate("std", 2000)) == 240
    assert tax_for(1200, TaxRate("std", 2000, inclusive=True)) == 200


def test_bracket_tax_within_first_bracket():
    assert bracket_tax(500_000, BRACKETS) == 0
    assert bracket_tax(0, BRACKETS) == 0
    assert bracket_tax(-100, BRACKETS) == 0
    assert bracket_tax(-100, [(None, 1000)]) == 0, "no negative tax"
    assert bracket_tax(1, [(None, 10000)]) == 1


def test_bracket_tax_middle_and_top():
    assert bracket_tax(2_000_000, BRACKETS) == 200_000
    assert bracket_tax(4_000_000, BRACKETS) == 600_000, "exactly at a limit"
    assert bracket_tax(5_000_000, BRACKETS) == 1_000_000


def test_bracket_tax_rounds_once_at_the_end():
    brackets = [(3, 5000), (None, 5000)]
    assert bracket_tax(5, brackets) == 2, "2.5 in total, half-even"
    assert bracket_tax(5, brackets, "half_up") == 3


def test_bracket_tax_bounded_last_bracket():
    assert bracket_tax(1000, [(1000, 1000)]) == 100
    with pytest.raises(ValueError):
        bracket_tax(1001, [(1000, 1000)])


def test_bracket_tax_limits_must_increase():
    with pytest.raises(ValueError):
        bracket_tax(2000, [(1000, 0), (1000, 100)])
    with pytest.raises(ValueError):
        bracket_tax(2000, [(1000, 0), (500, 100), (None, 200)])


def test_effective_rate():
    assert effective_rate(200, 1000) == 2000
    assert effective_rate(1, 3) == 3333
    assert effective_rate(600_000, 4_000_000) == 1500
    assert effective_rate(1, 1) == 10000
    assert effective_rate(5, 0) == 0
    assert effective_rate(5, -10) == 0


def test_taxes_by_code_mixes_inclusive_and_exclusive():
    rates = {"std": TaxRate("std", 2000), "low": TaxRate("low", 500, inclusive=True)}
    taxes = taxes_by_code({"std": 1000, "low": 1000}, rates)
    assert taxes == {"low": 48, "std": 200}
    assert list(taxes) == ["low", "std"], "in code order"


def test_taxes_by_code_unknown_code():
    with pytest.raises(ValueError):
        taxes_by_code({"zz": 100}, {"std": TaxRate("std", 2000)})
