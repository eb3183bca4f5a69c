"""PolyKV: each layer scores with its own pattern and keeps its own share; the whole cache holds
the global budget after every eviction step; budget 1.0 is the DynamicCache."""
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

import vlm_kv
from vlm_kv.config import Budget
from vlm_kv.eviction.evictor import Evictor
from vlm_kv.models.adapters import get_adapter
from vlm_kv.policies import PolyKV, PolyKVAllocation
from vlm_kv.policies.polykv import split_capacity
from vlm_kv.storage.store import VarlenKVStore
from vlm_kv.policies.strategy import LayerEntry, Strategy, StrategyError
from vlm_kv.testing import tiny_model

N, D = 40, 4


def _fp(layers: int) -> dict:
    return {"family": "test", "config_hash": "x", "num_layers": layers}


def _strategy(patterns, shares, budget=0.25, decode=None) -> Strategy:
    total = sum(shares)
    layers = {"prefill": [LayerEntry(p, budget * s / total) for p, s in zip(patterns, shares)]}
    if decode is not None:
        layers["decode"] = [LayerEntry(p, budget * s / total) for p, s in zip(decode, shares)]
    return Strategy(model=_fp(len(patterns)), budget=budget, layers=layers).validate()


def _hand_built_layer(idx: int, strength: torch.Tensor) -> SimpleNamespace:
    """Layer whose entries received ``strength`` attention (H2O's state); keys along one axis."""
    store = VarlenKVStore(1, 1, D, torch.float32, torch.device("cpu"), state_names=("attn_sum",))
    keys = torch.zeros(1, 1, N, D)
    keys[..., 0] = strength
    store.append(keys, torch.randn(1, 1, N, D), torch.arange(N), torch.zeros(1, N, dtype=torch.uint8),
                 torch.ones(1, N, dtype=torch.bool))
    store.add_state("attn_sum", strength.view(1, 1, N).clone())
    return SimpleNamespace(layer_idx=idx, store=store, window_queries=None, window_positions=None,
                           scaling=1.0, seen=N)


def _kept(layer) -> set[int]:
    view = layer.store.padded_view()
    return set(view.positions[view.valid].tolist())


def test_split_capacity_is_proportional_capped_and_exact():
    assert split_capacity(40, [1, 1, 1, 1], 100) == [10, 10, 10, 10]
    assert split_capacity(40, [3, 1], 100) == [30, 10]
    assert split_capacity(40, [3, 1], 25) == [25, 15]          # surplus of a full layer moves on
    assert split_capacity(10, [1, 1, 1], 100) == [4, 3, 3]     # remainders: deterministic
    assert split_capacity(400, [0.1, 5, 1], 100) == [100, 100, 100]  # whole budget: every layer full
    for total, shares, limit in [(37, [0.3, 2.0, 1.1, 0.7], 12), (5, [1, 9], 3), (0, [1, 2], 4)]:
        caps = split_capacity(total, shares, limit)
        assert sum(caps) == min(total, limit * len(shares)) and max(caps) <= limit


def test_each_layer_keeps_what_its_own_pattern_keeps_at_its_own_budget():
    strength = torch.zeros(N)
    strength[[6, 11, 17, 23]] = 5.0  # heavy hitters, far from the start and the end
    layers = [_hand_built_layer(0, strength), _hand_built_layer(1, strength)]
    strategy = _strategy(["h2o", "streaming_llm"], [1, 2], budget=0.3)  # 40*0.3*2 = 24 -> 8 and 16
    evictor = Evictor(PolyKV(strategy=strategy), PolyKVAllocation(strategy=strategy), Budget(fraction=0.3))
    ledger = SimpleNamespace(valid_tokens=torch.tensor([N]), first_positions=torch.tensor([0]))
    assert evictor.due(N)
    evictor.evict(layers, ledger)
    # H2O at 8: half recent (4), then the 4 heavy hitters
    assert _kept(layers[0]) == {6, 11, 17, 23} | set(range(N - 4, N))
    # StreamingLLM at 16: 4 sinks + 12 most recent, heavy hitters ignored
    assert _kept(layers[1]) == {0, 1, 2, 3} | set(range(N - 12, N))


def test_decode_phase_uses_the_decode_pattern():
    strength = torch.zeros(N)
    strength[[6, 11, 17, 23]] = 5.0
    layers = [_hand_built_layer(0, strength)]
    strategy = _strategy(["h2o"], [1], budget=0.2, decode=["streaming_llm"])
    evictor = Evictor(PolyKV(strategy=strategy), PolyKVAllocation(strategy=strategy), Budget(fraction=0.2),
                      evict_every=1)
    ledger = SimpleNamespace(valid_tokens=torch.tensor([N]), first_positions=torch.tensor([0]))
    assert evictor.due(1) and evictor.phase == "decode"
    evictor.evict(layers, ledger)
    assert _kept(layers[0]) == {0, 1, 2, 3} | set(range(N - 4, N))


def _tiny(layers=2):
    return tiny_model("llama", num_layers=layers)


def _real(model, patterns, shares, budget, decode=None):
    s = _strategy(patterns, shares, budget, decode)
    s.model = get_adapter(model).fingerprint()
    return s.validate()


def _positions(cache, layer):
    view = cache.layers[layer].store.padded_view()
    return [sorted(view.positions[0, h][view.valid[0, h]].tolist()) for h in range(view.positions.shape[1])]


def test_on_a_model_each_layer_matches_its_single_policy_cache():
    model = _tiny()
    ids = torch.randint(5, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    strategy = _real(model, ["h2o", "streaming_llm"], [1, 1], 0.25)
    caches = {
        "polykv": vlm_kv.make_cache(model, policy="polykv", budget=0.25, strategy=strategy),
        "h2o": vlm_kv.make_cache(model, policy="h2o", budget=0.25),
        "streaming_llm": vlm_kv.make_cache(model, policy="streaming_llm", budget=0.25),
    }
    with torch.no_grad():
        for cache in caches.values():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
    # the prefill's attention is the full one whatever the cache: the first eviction compares exactly
    assert _positions(caches["polykv"], 0) == _positions(caches["h2o"], 0)
    assert _positions(caches["polykv"], 1) == _positions(caches["streaming_llm"], 1)
    assert _positions(caches["polykv"], 0) != _positions(caches["polykv"], 1)


@pytest.mark.parametrize("budget", [0.1, 0.3, 12])
def test_global_budget_holds_after_every_eviction_step(budget):
    model = _tiny(3)
    strategy = _real(model, ["snapkv", "h2o", "tova"], [1, 3, 2], 0.2, decode=["streaming_llm", "adakv", "h2o"])
    cache = vlm_kv.make_cache(model, policy="polykv", budget=budget, strategy=strategy,
                              options=vlm_kv.CacheOptions(evict_every=4))
    ids = torch.randint(5, model.config.vocab_size, (2, 48 + 40), generator=torch.Generator().manual_seed(0))
    after = []
    evict = cache.evict

    def checked():
        evict()
        per_layer = [layer.store.num_entries() for layer in cache.layers]
        after.append((cache.kv_bytes()["total"], cache.budget_bytes(), per_layer))

    cache.evict = checked
    with torch.no_grad():
        model(input_ids=ids[:, :48], past_key_values=cache, use_cache=True)
        for i in range(48, ids.shape[1]):
            model(input_ids=ids[:, i : i + 1], past_key_values=cache, use_cache=True)
    assert len(after) == 1 + 40 // 4
    for held, allowed, _ in after:
        assert held <= allowed
    if budget == 0.1:  # small enough that no layer is full: shares 1:3:2 hold
        a, b, c = after[-1][2]
        assert a < c < b


def test_budget_one_equals_dynamic_cache():
    model = _tiny(3)
    strategy = _real(model, ["snapkv", "h2o", "streaming_llm"], [1, 3, 2], 0.2)
    ids = torch.randint(5, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=20, do_sample=False)
    with torch.no_grad():
        ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kwargs)
        cache = vlm_kv.make_cache(model, policy="polykv", budget=1.0, strategy=strategy,
                                  options=vlm_kv.CacheOptions(evict_every=3))
        out = model.generate(ids, past_key_values=cache, **kwargs)
    assert torch.equal(out, ref)
    assert cache.eviction_steps > 1 and cache.evicted_entries == 0


def test_strategy_is_required_and_checked(tmp_path):
    model = _tiny()
    with pytest.raises(ValueError, match="needs a strategy"):
        vlm_kv.make_cache(model, policy="polykv", budget=0.2)
    other = _real(tiny_model("qwen2", num_layers=2), ["h2o", "tova"], [1, 1], 0.2)
    path = tmp_path / "other.json"
    other.save(str(path))
    with pytest.raises(StrategyError, match="calibrated for"):
        vlm_kv.make_cache(model, policy="polykv", budget=0.2, strategy=str(path))
    with pytest.raises(ValueError, match="strategy= is for policy 'polykv'"):
        vlm_kv.make_cache(model, policy="h2o", budget=0.2, strategy=str(path))


def test_gated_patterns_use_the_gates():
    from vlm_kv.testing import tiny_gates

    model = _tiny()
    strategy = _real(model, ["trimkv", "h2o"], [1, 1], 0.25)
    with pytest.raises(ValueError, match="needs retention gates"):
        vlm_kv.make_cache(model, policy="polykv", budget=0.25, strategy=strategy)
    cache = vlm_kv.make_cache(model, policy="polykv", budget=0.25, strategy=strategy,
                              gates=tiny_gates(model, kind="trimkv"))
    ids = torch.randint(5, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    assert cache.kv_bytes()["total"] <= cache.budget_bytes()


@pytest.mark.parametrize("policy", ["adakv", "h2o"])
def test_one_pattern_with_uniform_shares_is_that_policy(policy):
    model = _tiny(3)
    strategy = _real(model, [policy] * 3, [1, 1, 1], 0.2)
    ids = torch.randint(5, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(4))
    outs = []
    for kwargs in (dict(policy="polykv", strategy=strategy), dict(policy=policy)):
        cache = vlm_kv.make_cache(model, budget=0.2, **kwargs, options=vlm_kv.CacheOptions(evict_every=3))
        with torch.no_grad():
            outs.append(model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False,
                                       output_scores=True, return_dict_in_generate=True))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert all(torch.equal(a, b) for a, b in zip(outs[0].scores, outs[1].scores))


def test_smollm2_uses_the_shipped_strategy(smollm2):
    from vlm_kv.policies.polykv import default_strategy_for

    model, _ = smollm2
    path = default_strategy_for(model)
    assert path is not None and path.endswith("smollm2-135m-pg1342-b0.1.json")
    strategy = Strategy.load(path, model=model)
    assert strategy.num_layers == 30 and strategy.budget == pytest.approx(0.1)
    cache = vlm_kv.make_cache(model, policy="polykv", budget=0.1)
    assert cache.scorer.strategy.to_dict() == strategy.to_dict()
    assert default_strategy_for(_tiny()) is None
