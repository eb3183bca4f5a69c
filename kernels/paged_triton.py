"""Triton decode attention reading the paged FP store and the packed INT2 windows in place.

Split-K decode (flash-decoding): the grid is (rows, splits). Program (r, s) loads row r's
``g`` query heads once, walks its share of the row's FP entries through the block table and
its share of the row's INT2 windows (unpacking the 2-bit codes and applying the fp16 grid in
registers, so no dequantized copy is ever written), and keeps an online softmax (running max,
sum and weighted values, float32, base 2). Each kv tile is loaded once for all ``g`` query
heads of the group (padded to 16 rows for ``tl.dot``). A second small kernel merges the splits
and writes the output in the query dtype. Splits let a few long rows (batch 1, 3 kv heads)
still fill a GPU.

Same sources and result as ``paged_torch``; under ``TRITON_INTERPRET=1`` it runs on CPU
tensors (slowly), which is how the tests check it without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache

import torch
import triton
import triton.language as tl

from vlm_kv.kernels.layout import PagedShape, check_launches
from vlm_kv.kernels.sources import Int2Source, LaunchGroup, Source, TritonLaunch, launch_plan

LOG2E = 1.4426950408889634
# Tiles (kv entries per loop step) and warps, as compiled ahead of time for sm_80 and sm_90
# (kernels/aot.py, docs/kernels.md). At tile 64 over Triton's default 4 warps (the first choice)
# ptxas spilled registers in every INT2 variant read with the float32 (rotated) query, up to 16 KB
# of spill stores per thread at head_dim 128, and in some FP ones; at tile 32 over 8 warps INT2
# variants at head_dim 128 still spilled (up to 392 B), and fp32 FP ones a few bytes on sm_80.
# So a launch that unpacks INT2 windows or takes IEEE float32 dots runs tile 16, a 16-bit FP-only
# launch tile 32, both over 8 warps; the merge kernel spilled 16 B over 4 warps on sm_80 (256
# splits) and runs over 8. No variant the runtime launches spills.
DECODE_TILE = 32
DECODE_SMALL_TILE = 16
DECODE_NUM_WARPS = 8
MERGE_NUM_WARPS = 8
# (row, split) programs per multiprocessor the split count aims for on CUDA
PROGRAMS_PER_SM = 4


@triton.jit
def _online_tile(q, k, v, tmask, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr):
    """Fold one tile of keys/values [TILE, D] into the running softmax of q [G, D] (float32)."""
    s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION) * qk_scale
    s = tl.where(tmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    q_ptr, k_pool, v_pool, table_ptr, len_ptr,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, wtable_ptr, wcount_ptr, slot_ptr,
    acc_out, m_out, l_out,
    qk_scale, max_blocks, max_windows, fp_split, int2_split,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BS: tl.constexpr, W: tl.constexpr, TILE: tl.constexpr, HAS_INT2: tl.constexpr, HAS_HOLES: tl.constexpr,
    PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_t = tl.arange(0, TILE)
    gmask = offs_g < G
    dmask = offs_d < D
    q = tl.load(q_ptr + (row * G + offs_g[:, None]) * D + offs_d[None, :], mask=gmask[:, None] & dmask[None, :],
                other=0.0).to(tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)

    length = tl.load(len_ptr + row)
    start = split * fp_split
    end = tl.minimum(start + fp_split, length)
    for t0 in range(start, end, TILE):
        t = t0 + offs_t
        tmask = t < end
        blk = tl.load(table_ptr + row * max_blocks + t // BS, mask=tmask, other=0).to(tl.int64)
        base = (blk * BS + t % BS) * D
        kv_mask = tmask[:, None] & dmask[None, :]
        k = tl.load(k_pool + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_pool + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = _online_tile(q, k, v, tmask, m_i, l_i, acc, qk_scale, PRECISION)

    if HAS_INT2:
        count = tl.load(wcount_ptr + row) * W
        istart = split * int2_split
        iend = tl.minimum(istart + int2_split, count)
        byte_col = offs_d // 4
        shift = ((offs_d % 4) * 2).to(tl.int32)
        for t0 in range(istart, iend, TILE):
            t = t0 + offs_t
            tmask = t < iend
            win = tl.load(wtable_ptr + row * max_windows + t // W, mask=tmask, other=0).to(tl.int64)
            entry = win * W + t % W
            if HAS_HOLES:  # a slot whose entry is in full precision (or gone) is not attended here
                tmask = tmask & (tl.load(slot_ptr + entry, mask=tmask, other=0) != 0)
            kv_mask = tmask[:, None] & dmask[None, :]
            kbyte = tl.load(kc_ptr + entry[:, None] * (D // 4) + byte_col[None, :], mask=kv_mask, other=0).to(tl.int32)
            kcode = ((kbyte >> shift[None, :]) & 3).to(tl.float32)
            kscale = tl.load(ks_ptr + win[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            kzero = tl.load(kz_ptr + win[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            k = kcode * kscale + kzero
            vbyte = tl.load(vc_ptr + entry[:, None] * (D // 4) + byte_col[None, :], mask=kv_mask, other=0).to(tl.int32)
            vcode = ((vbyte >> shift[None, :]) & 3).to(tl.float32)
            vscale = tl.load(vs_ptr + entry, mask=tmask, other=0.0).to(tl.float32)
            vzero = tl.load(vz_ptr + entry, mask=tmask, other=0.0).to(tl.float32)
            v = vcode * vscale[:, None] + vzero[:, None]
            k = tl.where(kv_mask, k, 0.0)
            v = tl.where(kv_mask, v, 0.0)
            m_i, l_i, acc = _online_tile(q, k, v, tmask, m_i, l_i, acc, qk_scale, PRECISION)

    part = row * num_splits + split
    tl.store(m_out + part * G + offs_g, m_i, mask=gmask)
    tl.store(l_out + part * G + offs_g, l_i, mask=gmask)
    tl.store(acc_out + (part * G + offs_g[:, None]) * D + offs_d[None, :], acc, mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, num_splits,
                  G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr):
    """Combine a row's split partials (base-2 running max, sum, unnormalised values) into its output."""
    row = tl.program_id(0)
    offs_s = tl.arange(0, S_PAD)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    gmask = offs_g < G
    dmask = offs_d < D
    sg_mask = (offs_s[:, None] < num_splits) & gmask[None, :]
    m_all = tl.load(m_ptr + (row * num_splits + offs_s[:, None]) * G + offs_g[None, :], mask=sg_mask, other=float("-inf"))
    top = tl.max(m_all, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no entries anywhere: every weight is 0
    total = tl.zeros([G_PAD], tl.float32)
    out = tl.zeros([G_PAD, D_PAD], tl.float32)
    for split in range(0, num_splits):
        part = row * num_splits + split
        m_s = tl.load(m_ptr + part * G + offs_g, mask=gmask, other=float("-inf"))
        l_s = tl.load(l_ptr + part * G + offs_g, mask=gmask, other=0.0)
        weight = tl.exp2(m_s - top)
        total += l_s * weight
        acc = tl.load(acc_ptr + (part * G + offs_g[:, None]) * D + offs_d[None, :], mask=gmask[:, None] & dmask[None, :],
                      other=0.0)
        out += acc * weight[:, None]
    out = tl.where(total[:, None] > 0, out / tl.where(total > 0, total, 1.0)[:, None], 0.0)
    tl.store(out_ptr + (row * G + offs_g[:, None]) * D + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=gmask[:, None] & dmask[None, :])


# Triton decides at decoration time whether a kernel is compiled or interpreted, so record it.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_tile(reads_int2: bool, precision: str) -> int:
    """The launcher's tile: the small one where INT2 windows are unpacked or the dots run in IEEE float32
    (more live registers per entry), the larger one for 16-bit FP-only launches."""
    return DECODE_TILE if not reads_int2 and precision == "tf32" else DECODE_SMALL_TILE


def splits_for(rows: int, capacity: int, tile: int, programs: int) -> int:
    """Splits per row so that about ``programs`` (row, split) programs run, never more splits than tiles."""
    most = max(1, -(-capacity // tile))
    return max(1, min(most, -(-programs // max(rows, 1))))


def _choose_splits(rows: int, capacity: int, tile: int, device: torch.device) -> int:
    """Enough (row, split) programs to fill the device."""
    programs = PROGRAMS_PER_SM * _multiprocessors(device) if device.type == "cuda" else 2 * rows
    return splits_for(rows, capacity, tile, programs)


def _placeholder_windows(int2: Int2Source, head_dim: int) -> Int2Source:
    """An empty window pool (nothing quantized yet) has no valid pointer to hand to the kernel: one
    zero window stands in; every count is then 0 and it is never read."""
    w = int2.window
    return replace(int2, key_codes=int2.key_codes.new_zeros(1, w, head_dim // 4),
                   key_scale=int2.key_scale.new_zeros(1, head_dim), key_zero=int2.key_zero.new_zeros(1, head_dim),
                   value_codes=int2.value_codes.new_zeros(1, w, head_dim // 4),
                   value_scale=int2.value_scale.new_zeros(1, w), value_zero=int2.value_zero.new_zeros(1, w),
                   slot_mask=None if int2.slot_mask is None else int2.key_codes.new_zeros(1, w, dtype=torch.bool))


def _partials(query: torch.Tensor, shape: PagedShape, group: LaunchGroup, scaling: float | None,
              launch: TritonLaunch):
    """Run the split kernel over one launch group; returns each (row, split)'s (unnormalised values,
    base-2 max, sum). ``launch.tile`` None: ``decode_tile`` of the launch."""
    if query.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"the Triton decode kernel needs CUDA tensors (got {query.device}); on CPU set TRITON_INTERPRET=1 "
            "before importing vlm_kv.kernels.paged_triton, or use backend='torch'"
        )
    fp, int2 = group.fp, group.int2
    key_pool, value_pool, block_table, lengths = fp.key_pool, fp.value_pool, fp.block_table, fp.lengths
    # 16-bit q and k are exact in tf32 (>= 10 mantissa bits), so tensor cores lose nothing on the
    # logits there; fp32 stores keep full precision.
    precision = "ieee" if torch.float32 in (query.dtype, key_pool.dtype) else "tf32"
    tile = launch.tile
    if tile is None:
        tile = decode_tile(int2 is not None, precision)
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= 16, got {tile}")
    rows, g, d = shape.rows, shape.group, shape.head_dim
    q = query.reshape(rows, g, d).contiguous()
    # An empty pool (nothing stored yet in that tier) has no valid pointer to hand to the
    # kernel; every length/count is then 0 and the placeholder is never read.
    if key_pool.numel() == 0:
        key_pool = value_pool = key_pool.new_zeros(1, shape.block_size, d)
    if int2 is not None and int2.key_codes.numel() == 0:
        int2 = _placeholder_windows(int2, d)
    fp_capacity = shape.max_blocks * shape.block_size
    holes = None
    if int2 is not None:
        kc, ks, kz, vc, vs, vz = int2.pools()
        wtable, wcount = int2.table, int2.counts
        # bool and uint8 share one byte per element: a view, not a copy, on every decode step
        holes = int2.slot_mask.view(torch.uint8) if int2.slot_mask is not None else None
        w = kc.shape[1]
        int2_capacity = wtable.shape[1] * w
    else:
        kc = ks = kz = vc = vs = vz = wtable = wcount = lengths  # never read: HAS_INT2 is False
        w, int2_capacity = 1, 0
    splits = launch.num_splits or _choose_splits(rows, max(fp_capacity, int2_capacity), tile, query.device)
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {splits}")
    # Each split takes a whole number of tiles of each tier, so tiles never straddle splits.
    fp_split = max(tile, -(-fp_capacity // (splits * tile)) * tile)
    int2_split = max(tile, -(-int2_capacity // (splits * tile)) * tile)
    acc = torch.empty(rows, splits, g, d, dtype=torch.float32, device=query.device)
    m = torch.empty(rows, splits, g, dtype=torch.float32, device=query.device)
    l = torch.empty_like(m)
    scale = scaling if scaling is not None else d ** -0.5
    _decode_kernel[(rows, splits)](
        q, key_pool, value_pool, block_table, lengths,
        kc, ks, kz, vc, vs, vz, wtable, wcount, holes if holes is not None else lengths,
        acc, m, l,
        float(scale * LOG2E), shape.max_blocks, wtable.shape[1] if int2 is not None else 1, fp_split, int2_split,
        G=g, G_PAD=max(16, _next_pow2(g)), D=d, D_PAD=max(16, _next_pow2(d)),
        BS=shape.block_size, W=w, TILE=tile, HAS_INT2=int2 is not None, HAS_HOLES=holes is not None,
        PRECISION=precision, num_warps=DECODE_NUM_WARPS,
    )
    return acc, m, l


def _merged_in_kernel(query: torch.Tensor, shape: PagedShape, group: LaunchGroup, scaling: float | None,
                      launch: TritonLaunch) -> torch.Tensor:
    """One launch, its splits combined by the merge kernel; [B, Hq, D] in the query dtype."""
    acc, m, l = _partials(query, shape, group, scaling, launch)
    rows, splits, g, d = acc.shape
    out = torch.empty(rows, g, d, dtype=query.dtype, device=query.device)
    _merge_kernel[(rows,)](acc, m, l, out, splits, G=g, G_PAD=_next_pow2(g), D=d, D_PAD=_next_pow2(d),
                           S_PAD=_next_pow2(splits), num_warps=MERGE_NUM_WARPS)
    return out.view(shape.batch, shape.num_query_heads, d)


def _group_partials(query: torch.Tensor, shape: PagedShape, group: LaunchGroup, scaling: float | None,
                    launch: TritonLaunch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A launch's partials in the channel basis: windows quantized in a rotated basis (keys
    ``k @ Rk``, values ``v @ Rv``) are read with the query ``q @ Rk`` (float32), since
    ``q . k = (q Rk) . (k Rk)``, and their partial values are rotated back by ``Rv.T``; the softmax
    max and sum do not depend on the value basis."""
    int2 = group.int2
    key_basis = int2.key_basis if int2 is not None else None
    value_basis = int2.value_basis if int2 is not None else None
    q = query if key_basis is None else query.float() @ key_basis
    acc, m, l = _partials(q, shape, group, scaling, launch)
    if value_basis is not None:
        acc = acc @ value_basis.T
    return acc, m, l


def paged_decode_attention_triton(
    query: torch.Tensor,
    sources: Sequence[Source],
    scaling: float | None = None,
    validate: bool = True,
    launch: TritonLaunch | None = None,
) -> torch.Tensor:
    """Decode attention of ``query`` [B, Hq, D] over ``sources`` in ONE softmax; [B, Hq, D] in the query dtype.

    The sources are read in launches (``sources.launch_plan``): each paged source, with the INT2
    windows in the channel basis that follow it, in one walk of the split kernel; INT2 windows in
    a rotated basis in a launch of their own, with the rotated query. A step read by one launch in
    the channel basis has its splits combined by the merge kernel (``launch.merge="kernel"``);
    otherwise the partial (max, sum, values) of every launch are merged in float32 PyTorch ops.
    ``launch``: splits, tile and merge (``TritonLaunch``; None: the defaults).
    """
    launch = launch or TritonLaunch()
    groups = launch_plan(query, sources)
    shapes = check_launches(query, groups, validate)
    if len(groups) == 1 and launch.merge == "kernel" and not (groups[0].int2 is not None and groups[0].int2.rotated):
        return _merged_in_kernel(query, shapes[0], groups[0], scaling, launch)
    accs, ms, ls = [], [], []
    for group, shape in zip(groups, shapes):
        acc, m, l = _group_partials(query, shape, group, scaling, launch)
        accs.append(acc), ms.append(m), ls.append(l)
    acc, m, l = torch.cat(accs, dim=1), torch.cat(ms, dim=1), torch.cat(ls, dim=1)
    top = m.max(dim=1, keepdim=True).values
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # a row with no entries anywhere
    weight = torch.exp2(m - top)
    total = (l * weight).sum(dim=1)
    out = (acc * weight[..., None]).sum(dim=1)
    out = torch.where(total[..., None] > 0, out / total.clamp(min=1e-30)[..., None], torch.zeros_like(out))
    b, hq, d = query.shape
    return out.to(query.dtype).view(b, hq, d)


__all__ = ["paged_decode_attention_triton", "splits_for", "decode_tile", "INTERPRETED", "DECODE_TILE",
           "DECODE_SMALL_TILE", "DECODE_NUM_WARPS", "MERGE_NUM_WARPS", "PROGRAMS_PER_SM"]
