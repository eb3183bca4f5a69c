"""A tiered layer's decode attention reads both tiers where they lie
(``attention.decode.decode_attention_with_rotated``) and matches the padded reference
(``attention.reference.rotated_tier_attention``)."""
import pytest
import torch

import vlm_kv
from vlm_kv.attention import decode, reference
from vlm_kv.config import CacheOptions
from vlm_kv.testing import tiny_gates, tiny_inputs, tiny_model

CASES = [
    ("llama", "snapkv", "int2", 2, torch.float32),
    ("qwen2", "dbtrimkv", "int2", 2, torch.float32),  # ragged FP body, INT2 windows with holes
    ("llama", "snapkv", {"basis": "channel"}, 1, torch.float32),  # no basis: keys and values as stored
    ("llama", "snapkv", {"fp_unit": "token"}, 2, torch.float32),
    ("qwen2", "dbtrimkv", "int2", 2, torch.bfloat16),
]


def _prefilled(family, policy, tiers, batch, dtype):
    model = tiny_model(family, dtype=dtype, num_layers=2)
    inputs = tiny_inputs(model, batch_size=batch, num_images=0, text_len=300, left_pad=6)
    extra = {"gates": tiny_gates(model)} if policy == "dbtrimkv" else {"options": CacheOptions(scorer_kwargs={"window": 4})}
    cache = vlm_kv.make_cache(model, policy=policy, budget=0.2, tiers=tiers, **extra)
    with torch.no_grad():
        model(**inputs, cache=cache)
    return model, cache


@pytest.mark.parametrize("family,policy,tiers,batch,dtype", CASES)
def test_decode_over_both_tiers_matches_the_padded_reference(family, policy, tiers, batch, dtype):
    model, cache = _prefilled(family, policy, tiers, batch, dtype)
    gen = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        store, tier = layer.store, layer.tier
        assert tier.num_active > 0  # the case exercises INT2 windows
        query = torch.randn(batch, model.config.num_attention_heads, 1, store.head_dim, generator=gen).to(dtype)
        fp = store.padded_view(with_values=True)
        tv = tier.view(with_values=True, dtype=torch.float32, in_basis=True)
        want = reference.rotated_tier_attention(query, fp, tv.view, tier.key_basis, tier.value_basis,
                                                torch.tensor([layer.seen]), layer.scaling)
        got = decode.decode_attention_with_rotated(query, store, tier.rotated_entries(), tier.key_basis,
                                                   tier.value_basis, layer.scaling)
        assert got.shape == want.shape and got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_a_sequence_without_int2_windows_attends_its_fp_entries_only():
    model, cache = _prefilled("llama", "snapkv", "int2", 2, torch.float32)
    layer = cache.layers[0]
    entries = layer.tier.rotated_entries()
    assert len(entries) == 2
    empty = decode.RotatedEntries(entries[0].keys[:0], entries[0].values[:0], entries[0].head[:0])
    query = torch.randn(2, model.config.num_attention_heads, 1, layer.store.head_dim)
    got = decode.decode_attention_with_rotated(query, layer.store, [empty, empty], layer.tier.key_basis,
                                               layer.tier.value_basis, layer.scaling)
    want, _ = decode.decode_attention(query, layer.store, layer.scaling)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_unattended_slots_get_no_weight():
    model, cache = _prefilled("llama", "snapkv", "int2", 1, torch.float32)
    layer = cache.layers[1]
    (entries,) = layer.tier.rotated_entries()
    query = torch.randn(1, model.config.num_attention_heads, 1, layer.store.head_dim)
    base = decode.decode_attention_with_rotated(query, layer.store, [entries], layer.tier.key_basis,
                                                layer.tier.value_basis, layer.scaling)
    # a slot marked unattended (-1) may hold anything: the output must not move
    head = entries.head.clone()
    head[0] = -1
    poisoned = decode.RotatedEntries(entries.keys.clone(), entries.values.clone(), head)
    poisoned.keys[0] = 1e4
    poisoned.values[0] = 1e4
    masked = decode.decode_attention_with_rotated(query, layer.store, [poisoned], layer.tier.key_basis,
                                                  layer.tier.value_basis, layer.scaling)
    clean = decode.RotatedEntries(entries.keys, entries.values, head)
    expected = decode.decode_attention_with_rotated(query, layer.store, [clean], layer.tier.key_basis,
                                                    layer.tier.value_basis, layer.scaling)
    torch.testing.assert_close(masked, expected)
    assert not torch.allclose(masked, base)  # dropping a slot does change the output
