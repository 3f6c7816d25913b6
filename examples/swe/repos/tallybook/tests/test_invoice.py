import pytest

from tallybook import Invoice, Line, TaxRate, volume_discount_bp

RATES = {
    "std": TaxRate("std", 2000),
    "red": TaxRate("red", 500),
    "inc": TaxRate("inc", 1000, inclusive=True),
}
TIERS = [(10, 500), (50, 1000), (100, 1500)]


def make_invoice(*lines, rounding="per_line"):
    invoice = Invoice(RATES, rounding=rounding)
    for line in lines:
        invoice.add(line)
    return invoice


def test_line_amounts():
    line = Line("Widget", 3, 1999, discount_bp=1000)
    assert line.gross() == 5997
    assert line.discount() == 600, "599.7 rounds to 600"
    assert line.net() == 5397


def test_volume_discount_tiers():
    assert volume_discount_bp(9, TIERS) == 0
    assert volume_discount_bp(10, TIERS) == 500, "a tier starts at its minimum"
    assert volume_discount_bp(49, TIERS) == 500
    assert volume_discount_bp(50, TIERS) == 1000
    assert volume_discount_bp(150, TIERS) == 1500


def test_volume_discount_tier_from_zero():
    assert volume_discount_bp(1, [(0, 200), (10, 500)]) == 200


def test_volume_discount_unsorted_tiers():
    assert volume_discount_bp(60, [(50, 1000), (10, 500)]) == 1000


def test_add_validates_lines():
    invoice = Invoice(RATES)
    with pytest.raises(ValueError):
        invoice.add(Line("Nothing", 0, 100))
    with pytest.raises(ValueError):
        invoice.add(Line("Mystery", 1, 100, tax_code="zz"))
    invoice.add(Line("Thing", 1, 100))
    assert len(invoice.lines) == 1


def test_unknown_rounding_rejected():
    with pytest.raises(ValueError):
        Invoice(RATES, rounding="per_week")


def test_subtotal_sums_discounted_lines():
    invoice = make_invoice(Line("A", 2, 1000), Line("B", 1, 500, discount_bp=2000))
    assert invoice.subtotal() == 2400


def test_tax_rounded_per_line():
    invoice = make_invoice(Line("A", 1, 333), Line("B", 1, 333))
    assert invoice.tax_by_code() == {"std": 134}, "66.6 rounds to 67 on each line"


def test_tax_rounded_per_invoice():
    invoice = make_invoice(Line("A", 1, 333), Line("B", 1, 333), rounding="per_invoice")
    assert invoice.tax_by_code() == {"std": 133}, "133.2 on the summed 666"


def test_tax_per_invoice_sums_before_rounding():
    lines = [Line("A", 1, 1001), Line("B", 1, 1001), Line("C", 1, 1000)]
    invoice = make_invoice(*lines, rounding="per_invoice")
    assert invoice.tax_by_code() == {"std": 600}, "600.4 on the summed 3002"


def test_tax_by_code_groups_codes_in_order():
    invoice = make_invoice(Line("A", 1, 1000), Line("B", 1, 2000, tax_code="red"))
    taxes = invoice.tax_by_code()
    assert taxes == {"red": 100, "std": 200}
    assert list(taxes) == ["red", "std"]


def test_total_adds_only_exclusive_tax():
    invoice = make_invoice(Line("A", 1, 1000), Line("B", 1, 1100, tax_code="inc"))
    assert invoice.tax_total() == 300, "200 exclusive plus 100 contained"
    assert invoice.total() == 2300


def test_status_open_and_partial():
    invoice = make_invoice(Line("A", 1, 1000))
    assert invoice.status() == "open"
    invoice.pay(500)
    assert invoice.status() == "partial"
    assert invoice.balance() == 700


def test_status_partial_after_one_cent():
    invoice = make_invoice(Line("A", 1, 1000))
    invoice.pay(1)
    assert invoice.status() == "partial"


def test_status_paid_and_overpaid():
    invoice = make_invoice(Line("A", 1, 1000))
    invoice.pay(1200)
    assert invoice.status() == "paid"
    invoice.pay(1)
    assert invoice.status() == "overpaid"
    assert invoice.balance() == -1


def test_pay_rejects_non_positive():
    invoice = make_invoice(Line("A", 1, 1000))
    with pytest.raises(ValueError):
        invoice.pay(0)
    invoice.pay(1)
    assert invoice.paid() == 1


def test_late_fee_grace_period():
    invoice = make_invoice(Line("A", 1, 10000, tax_code="inc"))
    assert invoice.late_fee(10, grace_days=14) == 0
    assert invoice.late_fee(14, grace_days=14) == 0, "the last day of grace is free"
    assert invoice.late_fee(15, grace_days=14) == 150


def test_late_fee_counts_started_months():
    invoice = make_invoice(Line("A", 1, 10000, tax_code="inc"))
    assert invoice.late_fee(30) == 150
    assert invoice.late_fee(31) == 300
    assert invoice.late_fee(60, monthly_bp=200) == 400


def test_late_fee_nothing_owed():
    invoice = make_invoice(Line("A", 1, 10000, tax_code="inc"))
    invoice.pay(10000)
    assert invoice.late_fee(90) == 0


def test_late_fee_never_negative():
    invoice = make_invoice(Line("A", 1, 10000, tax_code="inc"))
    assert invoice.late_fee(0, grace_days=60) == 0, "well before the due date"
    invoice.pay(20000)
    assert invoice.late_fee(90) == 0, "overpaid"


def test_late_fee_on_a_one_cent_balance():
    invoice = make_invoice(Line("A", 1, 1, tax_code="inc"))
    assert invoice.balance() == 1
    assert invoice.late_fee(30, monthly_bp=10000) == 1


def test_render_full_invoice():
    invoice = make_invoice(Line("Widget", 2, 1250), Line("Gadget with a very long name", 1, 99900))
    invoice.pay(20000)
    expected = "\n".join([
        "2 x Widget " + "." * 23 + " 25.00",
        "1 x Gadget with a very long name  999.00",
        "Subtotal " + "." * 22 + " 1,024.00",
        "Tax std 20% " + "." * 21 + " 204.80",
        "Total " + "." * 25 + " 1,228.80",
        "Paid " + "." * 28 + " 200.00",
        "Balance " + "." * 23 + " 1,028.80",
    ])
    assert invoice.render() == expected


def test_render_truncates_long_labels():
    invoice = make_invoice(Line("Extremely long product description", 1, 500, tax_code="inc"))
    first = invoice.render(width=24).splitlines()[0]
    assert first == "1 x Extremely lon~  5.00"
    assert invoice.render(width=6).splitlines()[0] == "~  5.00", "the amount is never cut"


def test_render_marks_inclusive_tax_and_skips_payments():
    invoice = make_invoice(Line("Book", 1, 1100, tax_code="inc"))
    rows = invoice.render().splitlines()
    assert rows[2].startswith("Tax inc 10% incl. ")
    assert rows[-1].startswith("Total ")
    assert len(rows) == 4
