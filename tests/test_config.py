import pytest

from vlm_kv.config import Budget, BudgetError


def test_fraction_and_tokens_parse():
    assert Budget.parse(0.1).fraction == 0.1
    assert Budget.parse(256).tokens_per_head == 256
    assert Budget.parse("0.25").fraction == 0.25
    assert Budget.parse("64").tokens_per_head == 64
    assert Budget.parse(1.0).fraction == 1.0
    assert Budget.parse("1.0").fraction == 1.0
    assert Budget.parse(2).tokens_per_head == 2


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, -3, "abc", float("nan"), True, 64.0, "64.0"])
def test_out_of_range_budgets_are_refused(bad):
    with pytest.raises(BudgetError):
        Budget.parse(bad)


def test_capacity():
    assert Budget.parse(0.1).capacity(2048) == 204
    assert Budget.parse(1.0).capacity(37) == 37
    assert Budget.parse(128).capacity(100) == 100
    assert Budget.parse(128).capacity(1000) == 128


@pytest.mark.parametrize("ambiguous", [1, "1", " 1 "])
def test_a_bare_one_is_refused_naming_both_spellings(ambiguous):
    # 1 could be the whole cache or one token per head: neither is guessed
    with pytest.raises(BudgetError, match=r"ambiguous: write 1\.0 for the whole cache.*int >= 2 for tokens per KV head"):
        Budget.parse(ambiguous)


def test_a_float_above_one_is_refused_pointing_at_the_int():
    with pytest.raises(BudgetError, match=r"fraction of the full cache is in \(0, 1\].*pass an int \(64\)"):
        Budget.parse(64.0)


def test_one_token_per_head_has_an_explicit_spelling():
    assert Budget.parse(Budget(tokens_per_head=1)).capacity(10) == 1


def test_make_cache_refuses_a_bare_one():
    import vlm_kv
    from vlm_kv.testing import tiny_model

    with pytest.raises(BudgetError, match="ambiguous"):
        vlm_kv.make_cache(tiny_model("llama"), policy="snapkv", budget=1)
