"""The Triton decode kernels against the PyTorch reference (interpreted on CPU, compiled on CUDA)."""

from dataclasses import replace

import pytest
import torch

from conftest import DEVICE
from kernel_stores import int2_source, paged_source, random_int2_store, random_paged_store
from vlm_kv.kernels import dispatch
from vlm_kv.kernels.paged_torch import paged_decode_attention_torch
from vlm_kv.kernels.sources import TritonLaunch

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
LENGTHS = [0, 7, 300, 33]  # batch 2 x 2 kv heads


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_triton_equals_torch(triton_kernels, group, dtype):
    store = random_paged_store(2, 2, group, 32, LENGTHS, block_size=16, dtype=dtype, device=DEVICE, seed=group)
    query, sources = store["query"], [paged_source(store)]
    ref = paged_decode_attention_torch(query, sources)
    for splits in (None, 1, 3):  # 3 splits of 320 capacity: tiles fall in every split, some rows end early
        out = triton_kernels.paged_decode_attention_triton(query, sources, launch=TritonLaunch(splits, tile=32))
        assert out.dtype == dtype and out.shape == ref.shape
        assert torch.allclose(out.float(), ref.float(), **TOL[dtype]), (splits, (out.float() - ref.float()).abs().max())
    assert bool((out[0, :group] == 0).all())


@pytest.mark.parametrize("key_grid", ["fp16", "int8"])  # int8: the compact grid, decoded to float32
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_triton_equals_torch(triton_kernels, group, dtype, key_grid):
    fp = random_paged_store(2, 2, group, 32, [0, 20, 0, 150], block_size=8, dtype=dtype, device=DEVICE, seed=7)
    int2 = random_int2_store(4, 32, [0, 4, 6, 11], window=8, device=DEVICE, key_grid=key_grid)
    sources = [paged_source(fp), int2_source(int2)]
    ref = paged_decode_attention_torch(fp["query"], sources, 0.2)
    for splits in (None, 2):
        out = triton_kernels.paged_decode_attention_triton(fp["query"], sources, 0.2, launch=TritonLaunch(splits, 16))
        assert torch.allclose(out.float(), ref.float(), **TOL[dtype]), (splits, (out.float() - ref.float()).abs().max())
    assert bool((out[0, :group] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_triton_skips_the_holes_of_windows_as_the_torch_path_does(triton_kernels, dtype):
    """Windows with holes (entries routed to FP, or gone): only the marked slots are attended."""
    fp = random_paged_store(2, 2, 3, 32, [5, 20, 0, 40], block_size=8, dtype=dtype, device=DEVICE, seed=3)
    int2 = random_int2_store(4, 32, [2, 4, 6, 3], window=8, device=DEVICE)
    n = int2["key_codes"].shape[0]
    slots = torch.rand(n, 8, generator=torch.Generator().manual_seed(1)) < 0.6
    slots[0] = False  # a window with every entry elsewhere
    slots = slots.to(DEVICE)
    query, pages = fp["query"], paged_source(fp)
    holed = [pages, int2_source(int2, slot_mask=slots)]
    ref = paged_decode_attention_torch(query, holed, 0.2)
    assert not torch.allclose(ref.float(), paged_decode_attention_torch(query, [pages, int2_source(int2)], 0.2).float(),
                              **TOL[dtype])
    for splits in (None, 2):
        out = triton_kernels.paged_decode_attention_triton(query, holed, 0.2, launch=TritonLaunch(splits, 16))
        assert torch.allclose(out.float(), ref.float(), **TOL[dtype]), (splits, (out.float() - ref.float()).abs().max())
    # the same as dropping the hole slots by hand: an explicit softmax over FP + attended INT2 entries
    from vlm_kv.kernels.paged_torch import gather_int2_rows, gather_paged_rows

    fk, fv, fvalid = gather_paged_rows(pages)
    qk, qv, qvalid = gather_int2_rows(int2_source(int2))
    most = qk.shape[1] // 8
    query = query.float()
    for r in range(4):
        attended = qvalid[r] & slots[int2["int2_table"][r, :most].long().clamp(min=0)].reshape(-1)
        k = torch.cat([fk[r][fvalid[r]].float(), qk[r][attended]])
        v = torch.cat([fv[r][fvalid[r]].float(), qv[r][attended]])
        for g in range(3):
            qh = (r % 2) * 3 + g
            want = torch.softmax(query[r // 2, qh] @ k.T * 0.2, dim=-1) @ v if k.shape[0] else torch.zeros(32)
            assert torch.allclose(ref[r // 2, qh].float(), want, **TOL[dtype])


def test_triton_backend_through_dispatcher(triton_kernels):
    store = random_paged_store(2, 1, 3, 16, [12, 40], block_size=4, device=DEVICE, seed=9)
    query, pages = store["query"], paged_source(store)
    assert dispatch.resolve_backend("triton", DEVICE) == "triton"
    out = dispatch.paged_decode_attention(query, [pages], backend="triton")
    assert torch.allclose(out, paged_decode_attention_torch(query, [pages]), **TOL[torch.float32])
    int2 = int2_source(random_int2_store(2, 16, [3, 20], window=8, device=DEVICE))  # 160 INT2 tokens: several tiles
    out = dispatch.paged_decode_attention(query, [pages, int2], backend="triton")
    assert torch.allclose(out, paged_decode_attention_torch(query, [pages, int2]), **TOL[torch.float32])
    # the merge kernel or float32 PyTorch ops combine the splits of one launch: the same attention
    merged = dispatch.paged_decode_attention(query, [pages, int2], backend="triton", launch=TritonLaunch(merge="torch"))
    assert torch.allclose(merged, out, **TOL[torch.float32])
    with pytest.raises(ValueError, match="merge must be"):
        TritonLaunch(merge="cuda")


def test_compiled_kernel_refuses_cpu_tensors(triton_kernels, monkeypatch):
    store = random_paged_store(1, 1, 1, 16, [4], block_size=4)
    monkeypatch.setattr(triton_kernels, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        triton_kernels.paged_decode_attention_triton(store["query"], [paged_source(store)])
    with pytest.raises(RuntimeError, match="backend='triton' cannot run"):
        dispatch.paged_decode_attention(store["query"], [paged_source(store)], backend="triton")


def test_empty_pools(triton_kernels):
    """Nothing stored yet in one tier (a pool with no blocks / no windows), or in both."""
    fp = random_paged_store(1, 2, 3, 16, [0, 0], block_size=4, spare_blocks=0, spare_columns=1, device=DEVICE)
    assert fp["key_pool"].shape[0] == 0
    query, pages = fp["query"], paged_source(fp)
    int2 = int2_source(random_int2_store(2, 16, [2, 0], window=4, spare_windows=0, device=DEVICE))
    ref = paged_decode_attention_torch(query, [pages, int2])
    out = triton_kernels.paged_decode_attention_triton(query, [pages, int2], launch=TritonLaunch(tile=16))
    assert torch.allclose(out, ref, **TOL[torch.float32]) and bool((out[0, 3:] == 0).all())
    empty = int2_source(random_int2_store(2, 16, [0, 0], window=4, spare_windows=0, spare_columns=1, device=DEVICE))
    assert empty.key_codes.shape[0] == 0
    assert bool((triton_kernels.paged_decode_attention_triton(query, [pages, empty], launch=TritonLaunch(tile=16)) == 0).all())
    holed = replace(empty, slot_mask=torch.zeros(0, 4, dtype=torch.bool, device=DEVICE))
    assert bool((triton_kernels.paged_decode_attention_triton(query, [pages, holed], launch=TritonLaunch(tile=16)) == 0).all())
    assert bool((triton_kernels.paged_decode_attention_triton(query, [pages], launch=TritonLaunch(tile=16)) == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sources_with_a_rotated_basis_attend_the_rotated_back_entries(triton_kernels, dtype):
    """INT2 windows quantized in a Hadamard basis: read with q @ H, their values rotated back, one softmax."""
    import torch.nn.functional as F

    from kernel_stores import row_entries
    from vlm_kv.kernels.int2 import hadamard_basis

    fp = random_paged_store(2, 2, 3, 32, [5, 20, 0, 40], block_size=8, dtype=dtype, device=DEVICE, seed=4)
    none = random_paged_store(2, 2, 3, 32, [0, 0, 0, 0], block_size=8, spare_blocks=0, spare_columns=1, dtype=dtype,
                              device=DEVICE)
    int2 = random_int2_store(4, 32, [3, 0, 2, 5], window=8, device=DEVICE)
    h = hadamard_basis(32, DEVICE)
    sources = [paged_source(fp), int2_source(int2, key_basis=h, value_basis=h)]
    out = triton_kernels.paged_decode_attention_triton(fp["query"], sources, 0.3, launch=TritonLaunch(tile=16))
    q = fp["query"].float().cpu()
    ref = torch.zeros_like(q)
    for r in range(4):
        k_fp, v_fp = row_entries(fp, None, r)
        k_q, v_q = row_entries(none, int2, r)
        keys, values = torch.cat([k_fp, k_q @ h.cpu()]), torch.cat([v_fp, v_q @ h.cpu()])
        if keys.shape[0]:
            b, kv = divmod(r, 2)
            qs = q[b, kv * 3:(kv + 1) * 3][:, None]
            ref[b, kv * 3:(kv + 1) * 3] = F.scaled_dot_product_attention(
                qs, keys[None].expand(3, -1, -1), values[None].expand(3, -1, -1), scale=0.3)[:, 0]
    assert out.dtype == dtype
    assert torch.allclose(out.float().cpu(), ref, **TOL[dtype]), (out.float().cpu() - ref).abs().max()
    # the PyTorch reference rotates the windows back instead of the query: the same attention
    torch_ref = paged_decode_attention_torch(fp["query"], sources, 0.3)
    assert torch.allclose(torch_ref.float().cpu(), ref, **TOL[dtype])
