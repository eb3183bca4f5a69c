"""A tiered layer's decode attention reads both tiers where they lie
(``attention.decode.decode_attention_with_rotated``) and matches the padded reference
(``attention.reference.rotated_tier_attention``); the C++ kernel the CPU runs by default
(``attention.backend.tiered_decode_attention_cpu``) matches that PyTorch path."""
import dataclasses

import pytest
import torch

from vlm_kv.attention import backend, decode, reference

CASES = [
    ("llama", "snapkv", "int2", 2, torch.float32),
    ("qwen2", "dbtrimkv", "int2", 2, torch.float32),  # ragged FP body, INT2 windows with holes
    ("llama", "snapkv", {"basis": "channel"}, 1, torch.float32),  # no basis: keys and values as stored
    ("llama", "snapkv", {"fp_unit": "token"}, 2, torch.float32),
    ("llama", "snapkv", {"key_grid": "fp16"}, 1, torch.float32),
    ("qwen2", "dbtrimkv", "int2", 2, torch.bfloat16),
]


@pytest.mark.parametrize("family,policy,tiers,batch,dtype", CASES)
def test_decode_over_both_tiers_matches_the_padded_reference_in_pytorch_and_in_the_kernel(
        family, policy, tiers, batch, dtype, prefilled_tiered):
    model, cache = prefilled_tiered(family, policy, tiers, batch, dtype)
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
        kernel = backend.tiered_decode_attention_cpu(query, store, tier.packed_windows(), tier.key_basis,
                                                     tier.value_basis, layer.scaling)
        assert kernel.shape == got.shape and kernel.dtype == dtype
        torch.testing.assert_close(kernel.float(), got.float(), rtol=tol, atol=tol)


def test_a_sequence_without_int2_windows_attends_its_fp_entries_only(prefilled_tiered):
    model, cache = prefilled_tiered("llama", "snapkv", "int2", 2, torch.float32)
    layer = cache.layers[0]
    entries = layer.tier.rotated_entries()
    assert len(entries) == 2
    e = entries[0]
    empty = decode.RotatedEntries(e.keys[:0], e.value_codes[:0], e.value_scale[:0], e.value_zero[:0],
                                  (0,) * layer.store.num_kv_heads)
    query = torch.randn(2, model.config.num_attention_heads, 1, layer.store.head_dim)
    got = decode.decode_attention_with_rotated(query, layer.store, [empty, empty], layer.tier.key_basis,
                                               layer.tier.value_basis, layer.scaling)
    want, _ = decode.decode_attention(query, layer.store, layer.scaling)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_unattended_slots_get_no_weight(prefilled_tiered):
    model, cache = prefilled_tiered("llama", "snapkv", "int2", 1, torch.float32)
    layer = cache.layers[1]
    (entries,) = layer.tier.rotated_entries()
    query = torch.randn(1, model.config.num_attention_heads, 1, layer.store.head_dim)
    base = decode.decode_attention_with_rotated(query, layer.store, [entries], layer.tier.key_basis,
                                                layer.tier.value_basis, layer.scaling)
    # a slot marked as a hole may hold anything: the output must not move
    holes = torch.zeros(len(entries), dtype=torch.bool)
    holes[0] = True
    poisoned = dataclasses.replace(entries, keys=entries.keys.clone(), value_codes=entries.value_codes.clone(), holes=holes)
    poisoned.keys[0] = 1e4
    poisoned.value_codes[0] = 1e4
    masked = decode.decode_attention_with_rotated(query, layer.store, [poisoned], layer.tier.key_basis,
                                                  layer.tier.value_basis, layer.scaling)
    clean = dataclasses.replace(entries, holes=holes)
    expected = decode.decode_attention_with_rotated(query, layer.store, [clean], layer.tier.key_basis,
                                                    layer.tier.value_basis, layer.scaling)
    torch.testing.assert_close(masked, expected)
    assert not torch.allclose(masked, base)  # dropping a slot does change the output


def test_entries_are_grouped_by_kv_head_in_the_order_the_counts_give(prefilled_tiered):
    """Each query head attends only its own KV head's run of INT2 entries: moving one entry's
    keys to another head's run (by the counts) changes only that head's query heads."""
    model, cache = prefilled_tiered("llama", "snapkv", "int2", 1, torch.float32)
    layer = cache.layers[0]
    (entries,) = layer.tier.rotated_entries()
    h, g = layer.store.num_kv_heads, model.config.num_attention_heads // layer.store.num_kv_heads
    assert len(entries.head_counts) == h and sum(entries.head_counts) == len(entries)
    assert min(entries.head_counts) > 0
    query = torch.randn(1, h * g, 1, layer.store.head_dim)
    base = decode.decode_attention_with_rotated(query, layer.store, [entries], layer.tier.key_basis,
                                                layer.tier.value_basis, layer.scaling)
    first = entries.head_counts[0]
    poisoned = dataclasses.replace(entries, keys=entries.keys.clone())
    poisoned.keys[first] = 50.0  # the first entry of KV head 1
    got = decode.decode_attention_with_rotated(query, layer.store, [poisoned], layer.tier.key_basis,
                                               layer.tier.value_basis, layer.scaling)
    moved = (got - base).abs().amax(dim=-1).view(h, g)
    assert moved[1].min() > 1e-4
    assert moved[torch.arange(h) != 1].max() == 0


def test_mismatched_head_counts_are_refused(prefilled_tiered):
    model, cache = prefilled_tiered("llama", "snapkv", "int2", 1, torch.float32)
    layer = cache.layers[0]
    (entries,) = layer.tier.rotated_entries()
    bad = dataclasses.replace(entries, head_counts=entries.head_counts[:-1])
    query = torch.randn(1, model.config.num_attention_heads, 1, layer.store.head_dim)
    with pytest.raises(ValueError, match="head counts"):
        decode.decode_attention_with_rotated(query, layer.store, [bad], layer.tier.key_basis,
                                             layer.tier.value_basis, layer.scaling)
