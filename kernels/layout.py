"""Checks of the paged FP store and the INT2 window pools that every kernel reads.

All decode backends read one decoder layer's cache in the layout below (see docs/kernels.md),
handed over as ``vlm_kv.kernels.sources`` dataclasses; they call these checks first so that a
malformed store raises a clear error instead of reading somebody else's entries.

Paged FP tier (``PagedSource``), rows = batch * num_kv_heads, row ``r = b * H + h``:

* ``key_pool``, ``value_pool``: [num_blocks, block_size, head_dim], model dtype;
* ``block_table``: [rows, max_blocks] int32, row r's j-th block is ``block_table[r, j]``;
* ``lengths``: [rows] int32, entry i of row r is slot ``i % block_size`` of block
  ``block_table[r, i // block_size]``.

INT2 tier (``Int2Source``, windows of ``w`` consecutive entries of one row, quantized once):

* ``key_codes``, ``value_codes``: [num_windows, w, head_dim // 4] uint8, four 2-bit codes per
  byte along head_dim (channel ``d`` in bits ``2 * (d % 4)`` and ``2 * (d % 4) + 1`` of byte
  ``d // 4``);
* ``key_scale``, ``key_zero``: [num_windows, head_dim] float16 (keys: per channel over the window),
  or float32 when decoded from a compact grid (``vlm_kv.kernels.int2.decode_key_grid``);
* ``value_scale``, ``value_zero``: [num_windows, w] float16 (values: per token over head_dim);
* ``table``: [rows, max_windows] int32, ``counts``: [rows] int32 windows held per row;
* optional ``slot_mask`` [num_windows, w] bool and ``key_basis`` / ``value_basis`` [head_dim, head_dim]
  float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_kv.kernels.sources import Int2Source, LaunchGroup, PagedSource

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class PagedShape:
    """Sizes read off a checked paged store."""

    batch: int
    num_query_heads: int
    num_kv_heads: int
    group: int
    head_dim: int
    block_size: int
    rows: int
    max_blocks: int


def check_paged_store(query: torch.Tensor, fp: PagedSource, validate_values: bool = True) -> PagedShape:
    """Check shapes, dtypes and devices of a decode call over ``fp``; with ``validate_values`` also
    that every length fits its row's blocks and every used block index is inside the pool (reads
    the tensors: a host sync on CUDA)."""
    key_pool, value_pool, block_table, lengths = fp.key_pool, fp.value_pool, fp.block_table, fp.lengths
    if query.dim() != 3:
        raise ValueError(f"query must be [batch, query_heads, head_dim], got shape {tuple(query.shape)}")
    if query.dtype not in FLOAT_DTYPES:
        raise ValueError(f"query dtype {query.dtype} is not one of {FLOAT_DTYPES}")
    if key_pool.dim() != 3:
        raise ValueError(f"key_pool must be [num_blocks, block_size, head_dim], got {tuple(key_pool.shape)}")
    if value_pool.shape != key_pool.shape:
        raise ValueError(f"value_pool shape {tuple(value_pool.shape)} != key_pool shape {tuple(key_pool.shape)}")
    if key_pool.dtype != value_pool.dtype or key_pool.dtype not in FLOAT_DTYPES:
        raise ValueError(f"key/value pools must share a float dtype, got {key_pool.dtype} and {value_pool.dtype}")
    if not (key_pool.is_contiguous() and value_pool.is_contiguous()):
        raise ValueError("key_pool and value_pool must be contiguous")
    b, hq, d = query.shape
    num_blocks, block_size, pool_d = key_pool.shape
    if pool_d != d:
        raise ValueError(f"query head_dim {d} != pool head_dim {pool_d}")
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be [rows, max_blocks] int32, "
                         f"got {tuple(block_table.shape)} {block_table.dtype}")
    if lengths.dim() != 1 or lengths.dtype != torch.int32:
        raise ValueError(f"lengths must be [rows] int32, got {tuple(lengths.shape)} {lengths.dtype}")
    rows = block_table.shape[0]
    if lengths.shape[0] != rows:
        raise ValueError(f"lengths has {lengths.shape[0]} rows, block_table {rows}")
    if rows == 0 or rows % b:
        raise ValueError(f"block_table rows {rows} is not batch {b} times a number of kv heads")
    h = rows // b
    if hq % h:
        raise ValueError(f"{hq} query heads are not a multiple of {h} kv heads (GQA)")
    for name, t in (("key_pool", key_pool), ("value_pool", value_pool), ("block_table", block_table),
                    ("lengths", lengths)):
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, query on {query.device}")
    shape = PagedShape(b, hq, h, hq // h, d, block_size, rows, block_table.shape[1])
    if validate_values:
        _check_table_values(block_table, lengths, block_size, num_blocks, "block_table", "lengths", "blocks")
    return shape


def _check_table_values(table: torch.Tensor, counts: torch.Tensor, per_slot: int, pool_size: int,
                        table_name: str, count_name: str, unit: str) -> None:
    """Counts within [0, capacity] and every used table entry inside the pool."""
    capacity = table.shape[1] * per_slot
    if counts.numel() == 0:
        return
    lo, hi = int(counts.min()), int(counts.max())
    if lo < 0:
        raise ValueError(f"{count_name} has a negative entry ({lo})")
    if hi > capacity:
        raise ValueError(f"{count_name} entry {hi} exceeds the table capacity {capacity} "
                         f"({table.shape[1]} {unit} x {per_slot})")
    used_columns = (counts.long() + per_slot - 1) // per_slot
    used = torch.arange(table.shape[1], device=table.device)[None, :] < used_columns[:, None]
    if bool(used.any()):
        ids = table[used]
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= pool_size:
            raise ValueError(f"{table_name} points outside the pool of {pool_size} {unit} "
                             f"(used entries range {low}..{high})")


_KEY_GRID_DTYPES = (torch.float16, torch.float32)


def check_int2_store(shape: PagedShape, device: torch.device, int2: Int2Source, validate_values: bool = True) -> int:
    """Check the INT2 window pools against the paged store's shape; returns the window size w.

    ``int2.slot_mask`` (optional, [num_windows, w] bool): which slots of each window are attended
    (windows with holes, where an entry lives in full precision or is gone); None: every slot."""
    key_codes, key_scale, key_zero, value_codes, value_scale, value_zero = int2.pools()
    table, counts, slot_mask = int2.table, int2.counts, int2.slot_mask
    d = shape.head_dim
    if d % 4:
        raise ValueError(f"INT2 packs four channels per byte: head_dim {d} must be a multiple of 4")
    if key_codes.dim() != 3 or key_codes.dtype != torch.uint8:
        raise ValueError(f"key_codes must be [num_windows, w, head_dim // 4] uint8, "
                         f"got {tuple(key_codes.shape)} {key_codes.dtype}")
    n, w, packed = key_codes.shape
    if packed != d // 4:
        raise ValueError(f"key_codes last dim {packed} != head_dim // 4 = {d // 4}")
    if w < 1:
        raise ValueError("window size must be >= 1")
    if value_codes.shape != key_codes.shape or value_codes.dtype != torch.uint8:
        raise ValueError(f"value_codes must match key_codes {tuple(key_codes.shape)} uint8, "
                         f"got {tuple(value_codes.shape)} {value_codes.dtype}")
    # key grids may come decoded from a compact grid (float32); values' grids are always float16
    for name, t, want, dtypes in (("key_scale", key_scale, (n, d), _KEY_GRID_DTYPES),
                                  ("key_zero", key_zero, (n, d), _KEY_GRID_DTYPES),
                                  ("value_scale", value_scale, (n, w), (torch.float16,)),
                                  ("value_zero", value_zero, (n, w), (torch.float16,))):
        if tuple(t.shape) != want or t.dtype not in dtypes:
            kinds = " or ".join(str(x).replace("torch.", "") for x in dtypes)
            raise ValueError(f"{name} must be {want} {kinds}, got {tuple(t.shape)} {t.dtype}")
    if key_scale.dtype != key_zero.dtype:
        raise ValueError(f"key_scale and key_zero must share a dtype, got {key_scale.dtype} and {key_zero.dtype}")
    if table.dim() != 2 or table.dtype != torch.int32 or table.shape[0] != shape.rows:
        raise ValueError(f"Int2Source.table must be [{shape.rows}, max_windows] int32, "
                         f"got {tuple(table.shape)} {table.dtype}")
    if counts.shape != (shape.rows,) or counts.dtype != torch.int32:
        raise ValueError(f"Int2Source.counts must be [{shape.rows}] int32, got {tuple(counts.shape)} {counts.dtype}")
    tensors = (("key_codes", key_codes), ("key_scale", key_scale), ("key_zero", key_zero),
               ("value_codes", value_codes), ("value_scale", value_scale), ("value_zero", value_zero),
               ("table", table), ("counts", counts))
    if slot_mask is not None:
        if tuple(slot_mask.shape) != (n, w) or slot_mask.dtype != torch.bool:
            raise ValueError(f"slot_mask must be [{n}, {w}] bool, got {tuple(slot_mask.shape)} {slot_mask.dtype}")
        tensors = tensors + (("slot_mask", slot_mask),)
    for name, basis in (("key_basis", int2.key_basis), ("value_basis", int2.value_basis)):
        if basis is not None:
            if tuple(basis.shape) != (d, d) or basis.dtype != torch.float32 or basis.device != device:
                raise ValueError(f"{name} must be [{d}, {d}] float32 on {device}, "
                                 f"got {tuple(basis.shape)} {basis.dtype} on {basis.device}")
    for name, t in tensors:
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, query on {device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if validate_values:
        _check_table_values(table, counts, 1, n, "Int2Source.table", "Int2Source.counts", "windows")
    return w


def check_launches(query: torch.Tensor, groups: list[LaunchGroup], validate_values: bool = True) -> list[PagedShape]:
    """Check every launch of a decode step (``sources.launch_plan``): each paged source against the
    query, its INT2 windows against it, and all of them over the same rows; the shape of each."""
    shapes = []
    for group in groups:
        shape = check_paged_store(query, group.fp, validate_values)
        if group.int2 is not None:
            check_int2_store(shape, query.device, group.int2, validate_values)
        if shapes and shape.rows != shapes[0].rows:
            raise ValueError(f"the sources of one decode step must share their rows: {shapes[0].rows} and {shape.rows}")
        shapes.append(shape)
    return shapes
