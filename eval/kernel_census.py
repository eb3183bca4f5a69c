"""Which Triton kernel variants the runtime launches: runs the cache's decode paths and the public
kernels API over a matrix of model dtypes and decode shapes with Triton's launcher recording
(``vlm_kv.kernels.aot``), so the AOT table compiles exactly what can run. It sits above the runtime
because it drives the cache's own decode paths; the kernels package below knows nothing of them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from vlm_kv.attention import backend
from vlm_kv.config import TierConfig
from vlm_kv.kernels import bench_kernels
from vlm_kv.kernels.aot import (
    LONG_CONTEXT,
    CompileRecord,
    DecodeShape,
    TargetSpec,
    Variant,
    decode_shapes,
    dtype_name,
    recorded_launches,
    specialize,
    variant_params,
)
from vlm_kv.kernels.dispatch import paged_decode_attention
from vlm_kv.kernels.int2 import INT2_BASES, KEY_GRIDS
from vlm_kv.kernels.layout import FLOAT_DTYPES
from vlm_kv.kernels.sources import TritonLaunch
from vlm_kv.storage.store import VarlenKVStore
from vlm_kv.tiers.int2_tier import Int2Tier, NewWindows, TierShape


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix: a model dtype and decode shape, launched for ``target`` with tensors on ``device``."""

    shape: DecodeShape
    dtype: Any   # torch.dtype
    target: TargetSpec
    device: Any  # torch.device

    def randn(self, *size: int, seed: int) -> Any:
        return torch.randn(*size, generator=torch.Generator().manual_seed(seed)).to(self.device, self.dtype)


def _fp_store(cell: Cell, batch: int = 1) -> Any:
    """A layer store with a ragged body (rows of different lengths) and a tail of 3 decode tokens,
    built through the store's own append and compaction."""

    h, d, prompt, dev = cell.shape.num_kv_heads, cell.shape.head_dim, 40, cell.device
    store = VarlenKVStore(batch, h, d, cell.dtype, dev)
    def text(q: int) -> tuple[Any, Any]:  # modality codes and validity of q new tokens
        return torch.zeros(batch, q, dtype=torch.uint8, device=dev), torch.ones(batch, q, dtype=torch.bool, device=dev)

    store.append(cell.randn(batch, h, prompt, d, seed=0), cell.randn(batch, h, prompt, d, seed=1), 0, *text(prompt))
    # row r keeps 21 - r % 5 entries: table widths are neither 1 nor a multiple of 16 (generic specialization)
    keep = torch.arange(prompt)[None, None, :] < (21 - torch.arange(batch * h) % 5).view(batch, h, 1)
    store.compact(keep.to(dev))
    for step in range(3):
        store.append(cell.randn(batch, h, 1, d, seed=2 + step), cell.randn(batch, h, 1, d, seed=5 + step), prompt + step,
                     *text(1))
    return store


@dataclass(frozen=True)
class TierChoice:
    """How the INT2 windows are stored: key grid, basis, and whether some windows have holes."""

    key_grid: str
    basis: str
    holes: bool


def _int2_tier(cell: Cell, choice: TierChoice, batch: int = 1) -> Any:
    """An ``Int2Tier`` holding 3 windows per row (the config's default window), filled through its own rebuild."""

    config = TierConfig(key_grid=choice.key_grid, basis=choice.basis)
    w, d, dev = config.window, cell.shape.head_dim, cell.device
    rows, per_row = batch * cell.shape.num_kv_heads, 3
    tier = Int2Tier(TierShape(batch, cell.shape.num_kv_heads, d, cell.dtype, dev), config)
    n = rows * per_row
    codes = tier.quantize(cell.randn(n, w, d, seed=10), cell.randn(n, w, d, seed=11))
    window_id = torch.arange(per_row, device=dev).repeat(rows)
    positions = (window_id[:, None] * w + torch.arange(w, device=dev)[None, :]).to(torch.int32)
    if choice.holes:
        positions[::2, 0] = -1  # an entry routed to FP (or gone): the window has a hole
    none = torch.zeros(0, dtype=torch.bool, device=dev)
    tier.rebuild(none, none, None, NewWindows(codes, torch.arange(rows, device=dev).repeat_interleave(per_row), window_id,
                                              positions, torch.zeros(n, w, dtype=torch.uint8, device=dev)))
    return tier


def _cache_launches(cell: Cell) -> Iterator[str]:
    """Run the cache's decode paths (the ones ``CompressedLayer.attend`` takes on CUDA); yields each path's label
    after its launches are recorded."""

    store = _fp_store(cell)
    shape = cell.shape
    query = cell.randn(1, shape.num_kv_heads * shape.group, 1, shape.head_dim, seed=20)
    scaling = shape.head_dim ** -0.5
    backend.decode_attention_triton(query, store, scaling)
    yield "cache: FP body + tail"
    for key_grid in KEY_GRIDS:
        for basis in INT2_BASES:
            for holes in (False, True):
                tier = _int2_tier(cell, TierChoice(key_grid, basis, holes))
                backend.tiered_decode_attention_triton(query, store, tier, scaling)
                yield f"cache: INT2 {key_grid} grid, {basis} basis" + (", holes" if holes else "")


def _api_launches(cell: Cell) -> Iterator[str]:
    """Run the public kernels API (``paged_decode_attention`` over a paged source, alone and with INT2 windows,
    as the bench and callers of ``vlm_kv.kernels`` do) on the Triton path at the bench's default block size and
    window, with the split count the launcher picks on the target for one sequence at a long context (the merge
    kernel's largest)."""

    # lazy: vlm_kv.kernels.paged_triton imports triton, which is optional
    from vlm_kv.kernels import paged_triton as pt

    defaults = bench_kernels.parse_args([])
    rows, d = cell.shape.num_kv_heads, cell.shape.head_dim
    fp = bench_kernels.build_store(rows, 100, d, defaults.block_size, cell.dtype, cell.device)
    int2 = bench_kernels.build_int2(rows, 3, defaults.window, d, cell.device)
    query = cell.randn(1, rows * cell.shape.group, d, seed=30)
    # at LONG_CONTEXT the device bounds the split count, whichever tile the launch takes
    splits = pt.splits_for(rows, LONG_CONTEXT, pt.DECODE_TILE, pt.PROGRAMS_PER_SM * cell.target.multiprocessors)
    launch = TritonLaunch(num_splits=splits)
    paged_decode_attention(query, [fp], backend="triton", launch=launch)
    yield "api: paged_decode_attention"
    paged_decode_attention(query, [fp, int2], backend="triton", launch=launch)
    yield "api: paged_decode_attention, INT2 windows"
    holes = torch.ones(int2.key_codes.shape[:2], dtype=torch.bool, device=cell.device)
    holes[::2, 0] = False
    paged_decode_attention(query, [fp, replace(int2, slot_mask=holes)], backend="triton", launch=launch)
    yield "api: paged_decode_attention, INT2 windows with holes"


@dataclass(frozen=True)
class Matrix:
    """Which cells to run: model dtypes (default: every float dtype) x decode shapes (default: ``decode_shapes()``)."""

    shapes: tuple[DecodeShape, ...] | None = None
    dtypes: tuple | None = None

    def cells(self, target: TargetSpec, device: Any) -> Iterator[Cell]:
        for dtype in self.dtypes or FLOAT_DTYPES:
            for shape in self.shapes or decode_shapes():
                yield Cell(shape, dtype, target, device)


def _collect(target: TargetSpec, matrix: Matrix, device: Any, run: bool) -> list[tuple[Variant, Any]]:
    """Every distinct variant the runtime paths launch over ``matrix``, each with the compiled kernel of its
    first real launch (``run``) or None."""

    found: dict[tuple, tuple[Variant, Any]] = {}
    with recorded_launches(run) as launches, torch.no_grad():
        for cell in matrix.cells(target, device):
            model = {"dtype": dtype_name(cell.dtype), "head_dim": cell.shape.head_dim, "group": cell.shape.group}
            for runner in (_cache_launches(cell), _api_launches(cell)):
                for path in runner:
                    for launch in launches:
                        signature, constexprs, aligned, options = specialize(launch)
                        params = variant_params(launch, signature, constexprs, options, model)
                        variant = Variant(launch.name, signature, constexprs, aligned, options, params)
                        variant, _ = found.setdefault(variant.key(), (variant, launch.compiled))
                        if path not in variant.paths:
                            variant.paths.append(path)
                    launches.clear()
    return list(found.values())


def census(target: TargetSpec, matrix: Matrix = Matrix()) -> list[Variant]:
    """Every distinct kernel variant the runtime launches on ``target`` over ``matrix``, deduplicated; each
    lists the runtime paths that launch it. Runs on CPU tensors; nothing is launched."""

    return [variant for variant, _ in _collect(target, matrix, torch.device("cpu"), run=False)]


def runtime_records(target: TargetSpec, matrix: Matrix = Matrix(), device: str = "cuda") -> list[CompileRecord]:
    """The AOT table's counterpart on a GPU: launch the census' variants for real (Triton compiles them
    just in time) and read registers and spills from the driver (``n_spills``: local memory / 4, as
    Triton reports it) and shared memory from the compiled kernel. ``target`` names the GPU's arch."""

    records = []
    for variant, compiled in _collect(target, matrix, torch.device(device), run=True):
        records.append(CompileRecord(
            variant.kernel, dict(variant.params), f"{target.name} (driver)", ok=True, n_regs=int(compiled.n_regs),
            n_spills=int(compiled.n_spills), shared_bytes=int(compiled.metadata.shared),
            max_shared_bytes=target.max_shared_bytes, paths=list(variant.paths)))
    return records
