"""Random paged FP stores and INT2 window pools for the kernel tests, plus naive references."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_kv.kernels.int2 import decode_key_grid, dequantize_keys, dequantize_values, quantize_keys, quantize_keys_compact, quantize_values
from vlm_kv.kernels.sources import Int2Source, PagedSource


def random_paged_store(batch: int, kv_heads: int, group: int, head_dim: int, lengths: list[int], block_size: int = 16,
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", spare_blocks: int = 3,
                       spare_columns: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows own shuffled blocks of one pool; table columns past a row's blocks are -1; spare blocks
    hold large values so reading a wrong block shows."""
    gen = torch.Generator().manual_seed(seed)
    rows = batch * kv_heads
    assert len(lengths) == rows
    per_row = [-(-n // block_size) for n in lengths]
    num_blocks = sum(per_row) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.full((rows, max(per_row) + spare_columns), -1, dtype=torch.int32)
    used = 0
    for r, n in enumerate(per_row):
        table[r, :n] = order[used : used + n].to(torch.int32)
        used += n
    key_pool = torch.randn(num_blocks, block_size, head_dim, generator=gen) * 50  # every slot starts as garbage
    value_pool = torch.randn(num_blocks, block_size, head_dim, generator=gen) * 50
    for r, n in enumerate(lengths):
        for i in range(n):
            blk, slot = int(table[r, i // block_size]), i % block_size
            key_pool[blk, slot] = torch.randn(head_dim, generator=gen)
            value_pool[blk, slot] = torch.randn(head_dim, generator=gen)
    query = torch.randn(batch, kv_heads * group, head_dim, generator=gen)
    return {
        "query": query.to(device, dtype),
        "key_pool": key_pool.to(device, dtype),
        "value_pool": value_pool.to(device, dtype),
        "block_table": table.to(device),
        "lengths": torch.tensor(lengths, dtype=torch.int32, device=device),
    }


def random_int2_store(rows: int, head_dim: int, counts: list[int], window: int = 8, spare_windows: int = 2,
                      spare_columns: int = 1, device: str | torch.device = "cpu", seed: int = 1,
                      key_grid: str = "fp16") -> dict[str, torch.Tensor]:
    """INT2 windows in shuffled pool slots; ``key_grid="int8"``: the keys' grid is compact and
    reaches the kernels decoded (float32), as the cache hands it over."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(counts) + spare_windows
    keys = torch.randn(n, window, head_dim, generator=gen) * (1 + 4 * torch.rand(1, 1, head_dim, generator=gen))
    values = torch.randn(n, window, head_dim, generator=gen)
    if key_grid == "fp16":
        kc, ks, kz = quantize_keys(keys)
    else:
        kc, zc, sc, ref = quantize_keys_compact(keys)
        ks, kz = decode_key_grid(zc, sc, ref)
    vc, vs, vz = quantize_values(values)
    order = torch.randperm(n, generator=gen)
    table = torch.full((rows, max(counts) + spare_columns), -1, dtype=torch.int32)
    used = 0
    for r, c in enumerate(counts):
        table[r, :c] = order[used : used + c].to(torch.int32)
        used += c
    store = {"key_codes": kc, "key_scale": ks, "key_zero": kz, "value_codes": vc, "value_scale": vs, "value_zero": vz,
             "int2_table": table, "int2_counts": torch.tensor(counts, dtype=torch.int32)}
    return {k: v.to(device) for k, v in store.items()}


FP_KEYS = ("query", "key_pool", "value_pool", "block_table", "lengths")
INT2_KEYS = ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero", "int2_table", "int2_counts")


def paged_source(store: dict) -> PagedSource:
    """The kernels' view of a ``random_paged_store``."""
    return PagedSource(*(store[k] for k in FP_KEYS[1:]))


def int2_source(store: dict, **extra) -> Int2Source:
    """The kernels' view of a ``random_int2_store``; ``extra``: slot_mask, key_basis, value_basis."""
    return Int2Source(*(store[k] for k in INT2_KEYS), **extra)


def row_entries(fp: dict, int2: dict | None, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row's keys and values (float32), one Python step per entry: FP entries, then dequantized windows."""
    bs = fp["key_pool"].shape[1]
    keys, values = [], []
    for i in range(int(fp["lengths"][row])):
        blk = int(fp["block_table"][row, i // bs])
        keys.append(fp["key_pool"][blk, i % bs].float())
        values.append(fp["value_pool"][blk, i % bs].float())
    if int2 is not None:
        for j in range(int(int2["int2_counts"][row])):
            win = int(int2["int2_table"][row, j])
            keys.extend(dequantize_keys(int2["key_codes"][win], int2["key_scale"][win], int2["key_zero"][win]))
            values.extend(dequantize_values(int2["value_codes"][win], int2["value_scale"][win], int2["value_zero"][win]))
    d = fp["key_pool"].shape[2]
    if not keys:
        return torch.zeros(0, d), torch.zeros(0, d)
    return torch.stack(keys).cpu(), torch.stack(values).cpu()


def naive_decode(fp: dict, int2: dict | None = None, scaling: float | None = None) -> torch.Tensor:
    """SDPA row by row over explicitly listed entries (the independent reference), float32 [B, Hq, D]."""
    q = fp["query"].float().cpu()
    b, hq, d = q.shape
    rows = fp["block_table"].shape[0]
    h = rows // b
    g = hq // h
    out = torch.zeros(b, hq, d)
    for r in range(rows):
        keys, values = row_entries(fp, int2, r)
        if keys.shape[0] == 0:
            continue
        bi, hi = divmod(r, h)
        qs = q[bi, hi * g : (hi + 1) * g][:, None, :]  # [g, 1, D]
        out[bi, hi * g : (hi + 1) * g] = F.scaled_dot_product_attention(
            qs, keys[None].expand(g, -1, -1), values[None].expand(g, -1, -1), scale=scaling)[:, 0]
    return out
