"""A tiered cache routes a prompt layer by layer (CacheOptions.layerwise_prefill), keeping exactly
what one routing event at the end of the forward keeps."""
import dataclasses

import pytest
import torch

import vlm_kv
from vlm_kv.config import CacheOptions
from vlm_kv.testing import attention_fails_at_call, tiny_inputs, tiny_model

# per-layer groups: snapkv (uniform), adakv (a layer's heads), pyramidkv, qevict (windows), kivi2
LAYERWISE = [("snapkv", "int2"), ("adakv", "int2"), ("pyramidkv", "int2"), ("qevict", None),
             ("snapkv", {"fp_unit": "token"})]


def _cache(model, policy, tiers, budget, layerwise, **options):
    options.setdefault("scorer_kwargs", {"window": 4} if policy in ("snapkv", "adakv", "pyramidkv") else None)
    return vlm_kv.make_cache(model, policy=policy, budget=budget, tiers=tiers,
                             options=CacheOptions(layerwise_prefill=layerwise, **options))


def _assert_same_tiers(a, b) -> None:
    for la, lb in zip(a.layers, b.layers):
        pa, ta = la.held_positions()
        pb, tb = lb.held_positions()
        assert torch.equal(pa, pb) and torch.equal(ta, tb)
        assert torch.equal(la.tier.row, lb.tier.row) and torch.equal(la.tier.active, lb.tier.active)
        assert torch.equal(la.tier.positions, lb.tier.positions)
        for field in dataclasses.fields(la.tier.codes):
            assert torch.equal(getattr(la.tier.codes, field.name), getattr(lb.tier.codes, field.name)), field.name


@pytest.mark.parametrize("policy,tiers", LAYERWISE)
def test_layerwise_routing_keeps_the_tiers_codes_and_logits_of_end_of_forward_routing(policy, tiers):
    model = tiny_model("llama", num_layers=3)
    inputs = tiny_inputs(model, batch_size=2, num_images=0, text_len=90, left_pad=5)
    kwargs = dict(**inputs, max_new_tokens=12, min_new_tokens=12, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    layerwise = _cache(model, policy, tiers, 0.25, True)
    at_end = _cache(model, policy, tiers, 0.25, False)
    model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], cache=layerwise)
    model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], cache=at_end)
    assert sum(layer.tier.num_active for layer in layerwise.layers) > 0  # the prompt put windows in INT2
    _assert_same_tiers(layerwise, at_end)
    # every layer was routed before the forward ended: the peak is the budget plus about one layer
    layer_bytes = at_end.full_kv_bytes() // at_end.num_layers
    assert layerwise.peak_kv_bytes <= layerwise.budget_bytes() + layer_bytes < at_end.peak_kv_bytes
    assert layerwise.eviction_steps == at_end.eviction_steps == 1
    assert layerwise.evicted_entries == at_end.evicted_entries
    # and generation continues identically
    out_a = model.generate(**kwargs, cache=_cache(model, policy, tiers, 0.25, True))
    out_b = model.generate(**kwargs, cache=_cache(model, policy, tiers, 0.25, False))
    assert torch.equal(out_a.sequences, out_b.sequences)
    assert torch.equal(torch.stack(out_a.logits), torch.stack(out_b.logits))


def test_kivi2_quantizes_each_layer_as_it_goes():
    model = tiny_model("llama", num_layers=3)
    ids = torch.randint(16, 200, (1, 400), generator=torch.Generator().manual_seed(2))
    caches = [_cache(model, "kivi2", None, 1.0, flag) for flag in (True, False)]
    logits = [model(input_ids=ids, cache=cache).logits for cache in caches]
    assert torch.equal(logits[0], logits[1])
    _assert_same_tiers(*caches)
    layer_bytes = caches[1].full_kv_bytes() // caches[1].num_layers
    assert caches[0].peak_kv_bytes < caches[1].peak_kv_bytes == caches[1].full_kv_bytes()
    assert caches[0].peak_kv_bytes <= caches[0].kv_bytes()["total"] + layer_bytes


def test_each_chunk_is_routed_layer_by_layer_with_the_same_result():
    model = tiny_model("qwen2", num_layers=3)
    ids = torch.randint(16, 200, (1, 240), generator=torch.Generator().manual_seed(3))
    chunked = _cache(model, "qevict", None, 0.1, True, prefill_chunk=60)
    at_end = _cache(model, "qevict", None, 0.1, False, prefill_chunk=60)
    logits = model(input_ids=ids, cache=chunked).logits
    assert torch.equal(model(input_ids=ids, cache=at_end).logits, logits)
    _assert_same_tiers(chunked, at_end)
    layer_chunk = at_end.full_kv_bytes() // at_end.num_layers * 60 // 240
    # the budget so far plus one layer's chunk (and the INT2 windows the budget pays for)
    assert chunked.peak_kv_bytes <= chunked.budget_bytes() + layer_chunk
    assert chunked.peak_kv_bytes < at_end.peak_kv_bytes


def _gated(model, budget, layerwise, gates, **options):
    return vlm_kv.make_cache(model, policy="dbtrimkv", budget=budget, tiers="int2", gates=gates,
                             options=CacheOptions(layerwise_prefill=layerwise, **options))


def _counters(cache):
    return [dataclasses.asdict(layer.tier.counters) for layer in cache.layers]


@pytest.mark.parametrize("budget,chunk", [(0.1, None), (0.25, None), (0.15, 50)])
def test_a_global_ranking_sends_what_can_no_longer_be_fp_to_int2_early_with_the_same_result(budget, chunk):
    model = tiny_model("llama", num_layers=4)
    gates = vlm_kv.testing.tiny_gates(model)
    inputs = tiny_inputs(model, batch_size=2, num_images=0, text_len=140, left_pad=7)
    feed = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    early, at_end = (_gated(model, budget, flag, gates, prefill_chunk=chunk) for flag in (True, False))
    assert torch.equal(model(**feed, cache=early).logits, model(**feed, cache=at_end).logits)
    _assert_same_tiers(early, at_end)
    assert _counters(early) == _counters(at_end)
    assert early.evicted_entries == at_end.evicted_entries and early.eviction_steps == at_end.eviction_steps
    assert early.kv_bytes() == at_end.kv_bytes()
    # the whole prompt (or chunk) no longer sits in every layer until the event
    assert early.peak_kv_bytes < at_end.peak_kv_bytes
    if chunk is None:
        assert at_end.peak_kv_bytes == at_end.full_kv_bytes()
    # decoding goes on identically
    kwargs = dict(**inputs, max_new_tokens=10, min_new_tokens=10, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    out_a = model.generate(**kwargs, cache=_gated(model, budget, True, gates, prefill_chunk=chunk))
    out_b = model.generate(**kwargs, cache=_gated(model, budget, False, gates, prefill_chunk=chunk))
    assert torch.equal(out_a.sequences, out_b.sequences)
    assert torch.equal(torch.stack(out_a.logits), torch.stack(out_b.logits))


def test_windows_that_can_no_longer_be_int2_are_dropped_before_the_event_with_the_same_result(monkeypatch):
    from vlm_kv.tiers import global_prefill

    drops = []
    real = global_prefill.GlobalPrefillRouting._drop_windows

    def spy(self):
        added = real(self)
        drops.append((len(self.entries), sum(added.values())))
        return added

    monkeypatch.setattr(global_prefill.GlobalPrefillRouting, "_drop_windows", spy)
    # bf16 and a small budget: an INT2 window costs about two entries, so the budget pays for far
    # fewer windows than the prompt has, and the bound on the INT2 set (not the count of windows
    # that must stay) decides what goes
    model = tiny_model("llama", dtype=torch.bfloat16, num_layers=6)
    gates = vlm_kv.testing.tiny_gates(model)
    inputs = tiny_inputs(model, batch_size=2, num_images=0, text_len=400, left_pad=7)
    feed = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    early, at_end = (_gated(model, 0.05, flag, gates) for flag in (True, False))
    assert torch.equal(model(**feed, cache=early).logits, model(**feed, cache=at_end).logits)
    assert any(seen < 6 and added for seen, added in drops)  # some went while layers were still to run
    _assert_same_tiers(early, at_end)
    assert _counters(early) == _counters(at_end)


def test_a_global_ranking_with_more_layers_holds_less_at_its_peak():
    # with many layers the FP copies kept are about the budget's: the peak falls well below the prompt
    model = tiny_model("llama", num_layers=8)
    gates = vlm_kv.testing.tiny_gates(model)
    ids = torch.randint(16, 200, (1, 256), generator=torch.Generator().manual_seed(8))
    early, at_end = (_gated(model, 0.1, flag, gates) for flag in (True, False))
    assert torch.equal(model(input_ids=ids, cache=early).logits, model(input_ids=ids, cache=at_end).logits)
    _assert_same_tiers(early, at_end)
    assert early.peak_kv_bytes < 0.6 * at_end.peak_kv_bytes


def test_a_failed_global_prefill_empties_the_cache_it_started_with():
    model = tiny_model("llama", num_layers=3)
    gates = vlm_kv.testing.tiny_gates(model)
    ids = torch.randint(16, 200, (1, 120), generator=torch.Generator().manual_seed(5))
    cache = _gated(model, 0.2, True, gates)
    with attention_fails_at_call(model, 3), pytest.raises(RuntimeError, match="boom"):  # layer 2: 0, 1 demoted
        model(input_ids=ids, cache=cache)
    assert cache.get_seq_length() == 0 and cache.num_entries() == 0
    ref = _gated(model, 0.2, False, gates)
    assert torch.equal(model(input_ids=ids, cache=cache).logits, model(input_ids=ids, cache=ref).logits)
    _assert_same_tiers(cache, ref)


def test_a_failure_after_some_layers_were_routed_empties_the_cache():
    model = tiny_model("llama", num_layers=3)
    ids = torch.randint(16, 200, (1, 120), generator=torch.Generator().manual_seed(5))
    cache = _cache(model, "qevict", None, 0.2, True, prefill_chunk=40)
    # layer 2 of the third chunk: layers 0 and 1 were routed already
    with attention_fails_at_call(model, 3 * 3), pytest.raises(RuntimeError, match="boom"):
        model(input_ids=ids, cache=cache)
    assert cache.get_seq_length() == 0 and cache.num_entries() == 0
    ref = _cache(model, "qevict", None, 0.2, True, prefill_chunk=40)
    assert torch.equal(model(input_ids=ids, cache=cache).logits, model(input_ids=ids, cache=ref).logits)
    _assert_same_tiers(cache, ref)


def test_a_new_turn_on_a_non_empty_cache_routes_at_its_end():
    model = tiny_model("llama", num_layers=2)
    ids = torch.randint(16, 200, (1, 150), generator=torch.Generator().manual_seed(7))
    caches = [_cache(model, "qevict", None, 0.2, flag) for flag in (True, False)]
    for cache in caches:
        model(input_ids=ids[:, :100], cache=cache)
        before = cache.peak_kv_bytes
        model(input_ids=ids[:, 100:], cache=cache)
        # the turn's tokens sit in every layer until its end: the peak may grow by the whole turn
        assert cache.peak_kv_bytes <= max(before, cache.budget_bytes() * 100 // 150 + cache.full_kv_bytes() * 50 // 150
                                          + cache.full_kv_bytes() // 10)
    _assert_same_tiers(*caches)


def test_layerwise_prefill_must_be_a_bool():
    with pytest.raises(TypeError, match="layerwise_prefill"):
        CacheOptions(layerwise_prefill="yes")


@pytest.mark.parametrize("policy,tiers", [("qevict", None), ("snapkv", None), ("dbtrimkv", "int2")])
def test_a_cpu_prefill_gives_each_layers_freed_memory_back(policy, tiers, monkeypatch):
    """Layer-by-layer eviction frees most of each layer's keys and values; on CPU the cache hands
    that heap back to the OS after each layer, or the resident set grows as if nothing were freed."""
    from vlm_kv.cache import cache as cache_module

    calls = []
    monkeypatch.setattr(cache_module, "return_freed_heap", lambda: calls.append(1) or True)
    monkeypatch.setattr(cache_module, "HEAP_TRIM_BYTES", 1)  # the tiny model frees a few KB a layer
    model = tiny_model("llama", num_layers=3)
    ids = torch.randint(16, 200, (1, 120), generator=torch.Generator().manual_seed(3))
    if policy == "dbtrimkv":
        cache = _gated(model, 0.25, True, vlm_kv.testing.tiny_gates(model))
    else:
        cache = _cache(model, policy, tiers, 0.25, True)
    model(input_ids=ids, cache=cache)
    assert len(calls) == model.config.num_hidden_layers
    model(input_ids=ids[:, :1], cache=cache)  # a decode step frees nothing layer by layer
    assert len(calls) == model.config.num_hidden_layers


def test_the_heap_is_trimmed_only_once_enough_was_freed(monkeypatch):
    """A trim costs a few ms: small prompts, which free little, do not pay for one per layer."""
    from vlm_kv.cache import cache as cache_module

    calls = []
    monkeypatch.setattr(cache_module, "return_freed_heap", lambda: calls.append(1) or True)
    model = tiny_model("llama", num_layers=4)
    ids = torch.randint(16, 200, (1, 120), generator=torch.Generator().manual_seed(3))
    probe = _cache(model, "qevict", None, 0.25, True)
    model(input_ids=ids, cache=probe)
    freed_per_layer = (probe.full_kv_bytes() - probe.kv_bytes()["total"]) // 4
    assert freed_per_layer > 0
    monkeypatch.setattr(cache_module, "HEAP_TRIM_BYTES", 2 * freed_per_layer)
    model(input_ids=ids, cache=_cache(model, "qevict", None, 0.25, True))
    assert 1 <= len(calls) <= 2  # every second layer, not every layer
    calls.clear()
    monkeypatch.setattr(cache_module, "HEAP_TRIM_BYTES", 16 * 2**20)
    model(input_ids=ids, cache=_cache(model, "qevict", None, 0.25, True))
    assert calls == []
