import pytest

from vlm_kv.budget import Budget, BudgetError


def test_fraction_and_tokens_parse():
    assert Budget.parse(0.1).fraction == 0.1
    assert Budget.parse(256).tokens_per_head == 256
    assert Budget.parse("0.25").fraction == 0.25
    assert Budget.parse("64").tokens_per_head == 64
    assert Budget.parse(1).fraction == 1.0


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, -3, "abc", float("nan"), True])
def test_out_of_range_budgets_are_refused(bad):
    with pytest.raises(BudgetError):
        Budget.parse(bad)


def test_capacity():
    assert Budget.parse(0.1).capacity(2048) == 204
    assert Budget.parse(1.0).capacity(37) == 37
    assert Budget.parse(128).capacity(100) == 100
    assert Budget.parse(128).capacity(1000) == 128
