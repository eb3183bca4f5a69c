"""make_cache's settings: what "full" takes, what tiers mean per policy, the model-free checks."""
import warnings

import pytest
import torch
from transformers import DynamicCache

import vlm_kv
from vlm_kv.api import check_cache_options
from vlm_kv.testing import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_full_is_a_dynamic_cache_and_takes_no_budget(model):
    assert type(vlm_kv.make_cache(model, policy="full")) is DynamicCache
    assert type(vlm_kv.make_cache(model, policy="full", budget=1.0)) is DynamicCache
    for budget in (0.1, 256):  # a budget it would not hold
        with pytest.raises(vlm_kv.BudgetError, match="'full' .* takes no budget"):
            vlm_kv.make_cache(model, policy="full", budget=budget)


@pytest.mark.parametrize("option", [{"tiers": "int2"}, {"evict_every": 4}, {"prefill_chunk": 32}, {"window": 4},
                                    {"allocation": "pyramid"}, {"slack": 2}])
def test_full_refuses_the_compression_options_it_would_ignore(model, option):
    (name,) = option
    with pytest.raises(ValueError, match=f"'full' compresses nothing, so {name}= would be ignored"):
        vlm_kv.make_cache(model, policy="full", **option)


def test_a_compressing_policy_defaults_to_a_quarter(model):
    assert vlm_kv.make_cache(model, policy="snapkv").budget == vlm_kv.Budget(fraction=0.25)


def test_checks_need_no_model():
    check_cache_options("qevict", 0.1, window=4)
    check_cache_options("full")
    with pytest.raises(vlm_kv.BudgetError, match="pass budget=1.0"):
        check_cache_options("kivi2", 0.25)
    with pytest.raises(vlm_kv.BudgetError, match="ambiguous"):
        check_cache_options("snapkv", 1)
    with pytest.raises(ValueError, match="cannot route windows to tiers"):
        check_cache_options("fastv", 0.5, tiers="int2")
    with pytest.raises(vlm_kv.BudgetError, match="attention sinks"):
        check_cache_options("streaming_llm", 3)
    with pytest.raises(TypeError, match="unknown cache option"):
        check_cache_options("snapkv", 0.5, windw=4)


def test_streaming_llm_tiers_rank_windows_by_recency(model):
    # documented meaning: sinks and the newest windows FP, the next newest INT2, the oldest evicted
    cache = vlm_kv.make_cache(model, policy="streaming_llm", budget=0.25, tiers="int2", window=4, int2_share=0.5)
    ids = torch.randint(16, 272, (1, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    for layer in cache.layers:
        positions, tier = layer.held_positions()
        fp = positions[tier == 0]
        fp = fp[fp >= 4]  # the sinks stay FP whatever their age
        int2 = positions[(tier == 1) & (positions >= 0)]
        evicted = torch.tensor(sorted(set(range(4, 96)) - set(positions[positions >= 0].tolist())))
        assert int2.numel() and evicted.numel()
        assert int(int2.max()) < int(fp.min()) and int(evicted.max()) < int(int2.min())


# ----------------------------------------------------------------------------- legacy keywords


def test_legacy_keywords_warn_and_build_the_same_cache():
    model = tiny_model("llama")
    with pytest.warns(DeprecationWarning, match=r"make_cache\(evict_every=, prefill_chunk=\) is deprecated"):
        old = vlm_kv.make_cache(model, "snapkv", 0.5, evict_every=4, prefill_chunk=32)
    new = vlm_kv.make_cache(model, "snapkv", 0.5, options=vlm_kv.CacheOptions(evict_every=4, prefill_chunk=32))
    assert (old.evict_every, old.prefill_chunk) == (new.evict_every, new.prefill_chunk) == (4, 32)
    with pytest.warns(DeprecationWarning, match="tiers="):
        old = vlm_kv.make_cache(model, "h2o", 0.5, tiers="int2", int2_share=0.5, window=4)
    new = vlm_kv.make_cache(model, "h2o", 0.5, tiers={"int2_share": 0.5, "window": 4})
    assert old.tiers == new.tiers and new.tiers.window == 4 and new.tiers.int2_share == 0.5
    with pytest.warns(DeprecationWarning):  # a policy tiered by itself takes tier keywords without tiers=
        assert vlm_kv.make_cache(model, "qevict", 0.5, window=4).tiers.window == 4


def test_new_spelling_does_not_warn_and_legacy_mixes_are_refused():
    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        vlm_kv.make_cache(model, "snapkv", 0.5, tiers="int2", options=vlm_kv.CacheOptions(evict_every=4))
        vlm_kv.make_cache(model, "snapkv", 0.5, tiers=vlm_kv.TierConfig(window=4))
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="inside options="):
        vlm_kv.make_cache(model, "snapkv", 0.5, options=vlm_kv.CacheOptions(), evict_every=4)
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="a TierConfig is the whole"):
        vlm_kv.make_cache(model, "snapkv", 0.5, tiers=vlm_kv.TierConfig(), window=4)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="pass tiers='int2' too"):
        vlm_kv.make_cache(model, "snapkv", 0.5, window=4)
    with pytest.raises(TypeError, match="unknown cache option"):
        vlm_kv.make_cache(model, "snapkv", 0.5, evict_evry=4)


def test_the_deprecation_names_the_callers_line():
    model = tiny_model("llama")
    for policy in ("snapkv", "full"):
        with pytest.warns(DeprecationWarning) as caught:
            try:
                vlm_kv.make_cache(model, policy, 1.0, slack=1) if policy == "snapkv" else vlm_kv.make_cache(
                    model, policy, evict_every=None)
            except ValueError:
                pass
        assert caught[0].filename == __file__
