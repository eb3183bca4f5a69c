import torch
import torch.nn.functional as F

from vlm_kv.attention.reference import attention_probs, soft_retention_attention, varlen_attention
from vlm_kv.storage.store import VarlenKVStore


def _filled_store(b=2, h=2, d=8, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    store = VarlenKVStore(b, h, d, torch.float32, torch.device("cpu"))
    k = torch.randn(b, h, n, d, generator=g)
    v = torch.randn(b, h, n, d, generator=g)
    store.append(k, v, torch.arange(n), torch.zeros(b, n, dtype=torch.uint8), torch.ones(b, n, dtype=torch.bool))
    return store, k, v


def _reference(q, k, v, keep, q_pos, k_pos):
    """SDPA over exactly the kept entries of each (batch, kv head), GQA by repetition."""
    b, hq, nq, d = q.shape
    h = k.shape[1]
    g = hq // h
    out = torch.empty(b, nq, hq, d)
    for bi in range(b):
        for hi in range(hq):
            kh = hi // g
            sel = keep[bi, kh]
            kk, vv, pp = k[bi, kh, sel], v[bi, kh, sel], k_pos[sel]
            mask = pp[None, :] <= q_pos[:, None]
            out[bi, :, hi] = F.scaled_dot_product_attention(q[bi, hi][None], kk[None], vv[None], attn_mask=mask[None])[0]
    return out


def test_varlen_attention_equals_sdpa_over_kept_entries_with_gqa():
    store, k, v = _filled_store()
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(2, 2, 12, generator=g) > 0.4
    keep[..., 0] = True
    store.compact(keep)
    # two new tokens arrive
    k2, v2 = torch.randn(2, 2, 2, 8, generator=g), torch.randn(2, 2, 2, 8, generator=g)
    store.append(k2, v2, torch.arange(12, 14), torch.zeros(2, 2, dtype=torch.uint8), torch.ones(2, 2, dtype=torch.bool))
    q = torch.randn(2, 4, 2, 8, generator=g)  # 4 query heads over 2 KV heads
    q_pos = torch.tensor([12, 13])
    out = varlen_attention(q, store.padded_view(), q_pos, None)
    all_k, all_v = torch.cat([k, k2], 2), torch.cat([v, v2], 2)
    all_keep = torch.cat([keep, torch.ones(2, 2, 2, dtype=torch.bool)], 2)
    ref = _reference(q, all_k, all_v, all_keep, q_pos, torch.arange(14))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_dense_path_matches_masked_path():
    store, k, v = _filled_store(n=9)
    q = torch.randn(2, 4, 9, 8)
    view = store.padded_view()
    a = varlen_attention(q, view, torch.arange(9), 0.3, dense_causal=True)
    b = varlen_attention(q, view, torch.arange(9), 0.3, dense_causal=False)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_attention_probs_rows_sum_to_one_and_respect_causality():
    store, _, _ = _filled_store(n=6)
    q = torch.randn(2, 4, 3, 8)
    probs = attention_probs(q, store.padded_view(), torch.tensor([3, 4, 5]), None)
    assert probs.shape == (2, 2, 2, 3, 6)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 2, 2, 3))
    assert float(probs[..., 0, 4:].abs().max()) == 0.0  # query at position 3 sees nothing after it


def test_soft_retention_with_zero_log_beta_is_plain_causal_attention_and_decays_otherwise():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 10, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g)
    plain = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    soft = soft_retention_attention(q, k, v, torch.zeros(1, 2, 10), None, None, chunk=3)
    torch.testing.assert_close(soft, plain.transpose(1, 2), atol=1e-5, rtol=1e-5)
    # a strongly decaying first entry stops mattering for late queries
    lb = torch.zeros(1, 2, 10)
    lb[..., 0] = -50.0
    decayed = soft_retention_attention(q, k, v, lb, None, None)
    ref = F.scaled_dot_product_attention(q[:, :, -1:], k.repeat_interleave(2, 1)[:, :, 1:], v.repeat_interleave(2, 1)[:, :, 1:])
    torch.testing.assert_close(decayed[:, -1:], ref.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_prefill_over_a_compressed_store_through_the_varlen_path_equals_the_padded_path():
    """The flash-attn wiring (pool, per-row table, bottom-right causal) checked with the same
    kernels module's PyTorch backend: a ragged body, then a 5-token tail attended causally."""
    from vlm_kv.attention.backend import prefill_attention_paged

    torch.manual_seed(0)
    b, h, g, d = 2, 2, 3, 8
    store = VarlenKVStore(b, h, d, torch.float32, torch.device("cpu"))
    k = torch.randn(b, h, 12, d)
    store.append(k, torch.randn(b, h, 12, d), torch.arange(12), torch.zeros(b, 12, dtype=torch.uint8),
                 torch.ones(b, 12, dtype=torch.bool))
    view = store.padded_view()
    keep = view.positions < (4 + torch.arange(b * h).view(b, h, 1))  # ragged: 4..7 entries per row
    store.compact(keep)
    store.append(torch.randn(b, h, 5, d), torch.randn(b, h, 5, d), torch.arange(12, 17),
                 torch.zeros(b, 5, dtype=torch.uint8), torch.ones(b, 5, dtype=torch.bool))
    query = torch.randn(b, h * g, 5, d)
    ref = varlen_attention(query, store.padded_view(), torch.arange(12, 17), None)
    out = prefill_attention_paged(query, store, None, backend="torch")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_over_a_small_uniform_store_takes_one_sdpa_call_and_equals_the_split_softmax(monkeypatch):
    from vlm_kv.attention import decode

    store, k, v = _filled_store(b=2, h=2, d=8, n=20, seed=3)
    store.compact(store.padded_view().positions % 3 != 1)  # a uniform body of 13 per head
    new_k, new_v = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
    store.append(new_k, new_v, torch.arange(20, 23), torch.zeros(2, 3, dtype=torch.uint8), torch.ones(2, 3, dtype=torch.bool))
    query = torch.randn(2, 4, 1, 8)  # GQA: 2 query heads per KV head
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(decode.F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    small, _ = decode.decode_attention(query, store, None)
    assert len(calls) == 1
    monkeypatch.setattr(decode, "SMALL_DECODE_ENTRIES", 0)
    split, _ = decode.decode_attention(query, store, None)
    assert len(calls) == 1  # the split softmax runs no SDPA
    torch.testing.assert_close(small, split, rtol=1e-5, atol=1e-6)
    keep = torch.zeros(2, 2, 23, dtype=torch.bool)
    keep[..., :20] = (torch.arange(20) % 3 != 1)
    keep[..., 20:] = True
    ref = _reference(query, torch.cat([k, new_k], 2), torch.cat([v, new_v], 2), keep, torch.tensor([22]), torch.arange(23))
    torch.testing.assert_close(small, ref, rtol=1e-5, atol=1e-6)


def test_decode_over_a_small_ragged_store_equals_the_split_softmax(monkeypatch):
    from vlm_kv.attention import decode

    store, k, v = _filled_store(b=2, h=2, d=8, n=20, seed=4)
    heads = torch.arange(2).view(1, 2, 1)
    keep = (store.padded_view().positions % (2 + heads)) != 1  # different lengths per head: ragged
    store.compact(keep)
    assert not store.uniform
    new_k, new_v = torch.randn(2, 2, 2, 8), torch.randn(2, 2, 2, 8)
    store.append(new_k, new_v, torch.arange(20, 22), torch.zeros(2, 2, dtype=torch.uint8), torch.ones(2, 2, dtype=torch.bool))
    query = torch.randn(2, 4, 1, 8)
    small, _ = decode.decode_attention(query, store, None)
    monkeypatch.setattr(decode, "SMALL_DECODE_ENTRIES", 0)
    split, _ = decode.decode_attention(query, store, None)
    torch.testing.assert_close(small, split, rtol=1e-5, atol=1e-6)
    full_keep = torch.cat([keep.expand(2, 2, 20), torch.ones(2, 2, 2, dtype=torch.bool)], dim=2)
    ref = _reference(query, torch.cat([k, new_k], 2), torch.cat([v, new_v], 2), full_keep, torch.tensor([21]), torch.arange(22))
    torch.testing.assert_close(small, ref, rtol=1e-5, atol=1e-6)


def _random_view(b, h, length, d, gen, valid_p=0.7):
    from vlm_kv.storage.store import PaddedView

    valid = torch.rand(b, h, length, generator=gen) < valid_p
    return PaddedView(keys=torch.randn(b, h, length, d, generator=gen), values=torch.randn(b, h, length, d, generator=gen),
                      positions=torch.randint(0, 40, (b, h, length), generator=gen), modality=torch.zeros(b, h, length, dtype=torch.uint8),
                      valid=valid, state={})


def test_rotated_tier_attention_equals_one_softmax_over_the_rotated_back_entries():
    from vlm_kv.attention.reference import rotated_tier_attention
    from vlm_kv.kernels.int2 import hadamard_basis
    from vlm_kv.storage.store import PaddedView
    from vlm_kv.tiers.window_router import merge_views

    gen = torch.Generator().manual_seed(3)
    fp, tier = _random_view(2, 2, 9, 16, gen), _random_view(2, 2, 12, 16, gen)
    fp.valid[1, 0] = False  # a row whose FP entries are all gone
    tier.valid[1, 1] = False  # a row with no INT2 entries
    h = hadamard_basis(16)
    query = torch.randn(2, 6, 1, 16, generator=gen)  # 3 query heads per kv head
    q_pos = torch.tensor([30])
    for key_basis, value_basis in ((h, h), (h, None), (None, None)):
        back = PaddedView(keys=tier.keys @ h.T if key_basis is not None else tier.keys,
                          values=tier.values @ h.T if value_basis is not None else tier.values,
                          positions=tier.positions, modality=tier.modality, valid=tier.valid, state={})
        merged, _ = merge_views(fp, back, sort=False)
        ref = varlen_attention(query, merged, q_pos, 0.3)
        out = rotated_tier_attention(query, fp, tier, key_basis, value_basis, q_pos, 0.3)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_attention_received_sums_the_same_whatever_its_chunk_and_bounds_a_chunk_in_bytes(monkeypatch):
    from vlm_kv.attention import reference

    store, _, _ = _filled_store(n=12)
    q = torch.randn(2, 4, 12, 8, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(12)
    view = store.padded_view()
    whole = reference.attention_received(q, view, positions, None, chunk=12)
    torch.testing.assert_close(whole.sum(-1), torch.full((2, 2), 12.0))  # each query's probabilities sum to 1
    chunks = []
    real_probs = reference.attention_probs

    def counting(query, *args):
        chunks.append(query.shape[2])
        return real_probs(query, *args)

    monkeypatch.setattr(reference, "attention_probs", counting)
    # 4 bytes x 2 sequences x 4 query heads x 12 keys = 384 bytes of probabilities a query: 2000 fit 5
    monkeypatch.setattr(reference, "RECEIVED_CHUNK_BYTES", 2000)
    torch.testing.assert_close(reference.attention_received(q, view, positions, None), whole)
    assert chunks == [5, 5, 2]


def test_masked_attention_takes_its_queries_in_blocks_within_the_mask_bound_with_the_same_output(monkeypatch):
    from vlm_kv.attention import reference

    gen = torch.Generator().manual_seed(5)
    view = _random_view(2, 2, 20, 8, gen)
    query = torch.randn(2, 4, 11, 8, generator=gen)  # 2 query heads per kv head
    q_pos = torch.arange(25, 36)
    whole = varlen_attention(query, view, q_pos, None)
    calls = []
    real_sdpa = F.scaled_dot_product_attention

    def counting(q, *args, **kwargs):
        calls.append(q.shape[2])
        return real_sdpa(q, *args, **kwargs)

    monkeypatch.setattr(reference.F, "scaled_dot_product_attention", counting)
    # 4 bytes x 2 sequences x 4 query heads x 20 entries = 640 bytes of float mask a query: 2000 fit 3
    monkeypatch.setattr(reference, "MASKED_BLOCK_BYTES", 2000)
    blocked = varlen_attention(query, view, q_pos, None)
    assert calls == [2 * 3, 2 * 3, 2 * 3, 2 * 2]  # packed rows: 2 query heads a kv head x the block's queries
    assert torch.equal(blocked, whole)
    torch.testing.assert_close(whole, _reference_view(query, view, q_pos), rtol=1e-5, atol=1e-6)


def _reference_view(query, view, q_pos):
    """Softmax over each query's visible entries, one (sequence, head, query) at a time."""
    b, hq, q, d = query.shape
    g = hq // view.keys.shape[1]
    out = torch.zeros(b, q, hq, d)
    for s in range(b):
        for head in range(hq):
            kv = head // g
            for i in range(q):
                seen = view.valid[s, kv] & (view.positions[s, kv] <= q_pos[i])
                logits = view.keys[s, kv][seen] @ query[s, head, i] * d ** -0.5
                out[s, i, head] = torch.softmax(logits, 0) @ view.values[s, kv][seen]
    return out
