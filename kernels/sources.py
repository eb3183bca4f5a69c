"""What a decode step reads: its sources, as small frozen dataclasses (layout in ``layout.py``).

A decode step attends one query per (batch, query head) over one or more sources of the same
rows (``rows = batch * num_kv_heads``) in ONE softmax:

* ``PagedSource``: full-precision entries in the paged layout (key and value pools, block table,
  per-row lengths), e.g. a cache's compacted body or its buffer of recent tokens;
* ``Int2Source``: INT2 windows (packed codes, key and value grids, window table and per-row counts),
  optionally with the attended-slot mask of windows with holes and the orthonormal basis the
  windows were quantized in.

``launch_plan`` groups the sources the way one Triton launch reads them: a launch walks one paged
source and, optionally, INT2 windows in the channel basis. Both backends follow the same plan, so
they check the same things and lay the entries out in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import torch


@dataclass(frozen=True)
class PagedSource:
    """Full-precision entries of every row in the paged layout.

    ``key_pool``, ``value_pool``: [num_blocks, block_size, head_dim], model dtype, contiguous;
    ``block_table``: [rows, max_blocks] int32; ``lengths``: [rows] int32 (entry i of row r is slot
    ``i % block_size`` of block ``block_table[r, i // block_size]``).
    """

    key_pool: torch.Tensor
    value_pool: torch.Tensor
    block_table: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def empty(cls, rows: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> PagedSource:
        """A source holding nothing (no blocks, one-entry block size, zero lengths): the FP side of a
        launch that reads INT2 windows only."""
        none = torch.zeros(0, 1, head_dim, dtype=dtype, device=device)
        zeros = torch.zeros(rows, dtype=torch.int32, device=device)
        return cls(none, none, zeros[:, None], zeros)

    @property
    def block_size(self) -> int:
        return self.key_pool.shape[1]


@dataclass(frozen=True)
class Int2Source:
    """INT2 windows of every row (``vlm_kv.kernels.int2``'s packing and grids).

    ``key_codes``, ``value_codes``: [num_windows, w, head_dim // 4] uint8; ``key_scale``,
    ``key_zero``: [num_windows, head_dim] float16 (float32 when decoded from a compact grid);
    ``value_scale``, ``value_zero``: [num_windows, w] float16; ``table``: [rows, max_windows] int32,
    row r's j-th window; ``counts``: [rows] int32 windows held per row.
    ``slot_mask`` (optional [num_windows, w] bool): the attended slots of windows with holes (an
    entry routed to full precision, or gone); None: every slot.
    ``key_basis``, ``value_basis`` (optional orthonormal [head_dim, head_dim] float32): the windows
    hold ``k @ key_basis`` and ``v @ value_basis`` (a Hadamard basis); None: the channel basis.
    """

    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_zero: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_zero: torch.Tensor
    table: torch.Tensor
    counts: torch.Tensor
    slot_mask: torch.Tensor | None = None
    key_basis: torch.Tensor | None = None
    value_basis: torch.Tensor | None = None

    @property
    def window(self) -> int:
        return self.key_codes.shape[1]

    @property
    def rotated(self) -> bool:
        """Quantized in a rotated basis: read with the query rotated the same way, values rotated back."""
        return self.key_basis is not None or self.value_basis is not None

    def pools(self) -> tuple[torch.Tensor, ...]:
        """The six tensors of the window pool, in the kernels' order (codes and grids, keys first)."""
        return (self.key_codes, self.key_scale, self.key_zero, self.value_codes, self.value_scale, self.value_zero)


Source = Union[PagedSource, Int2Source]


@dataclass(frozen=True)
class LaunchGroup:
    """What one Triton launch reads: a paged source and, optionally, INT2 windows in the same walk."""

    fp: PagedSource
    int2: Int2Source | None = None


def launch_plan(query: torch.Tensor, sources: Sequence[Source]) -> list[LaunchGroup]:
    """Group a step's sources, in order, into launches.

    Each paged source starts a launch. An INT2 source in the channel basis joins the launch of the
    paged source just before it when that launch reads no windows yet (one kernel walks both); any
    other INT2 source (the first source, one after another INT2 source, or a rotated one, which is
    read with a rotated query) gets a launch of its own beside an empty paged source of the step's
    FP dtype and device (the first paged source's, else the query's).
    """
    if isinstance(sources, (PagedSource, Int2Source)):
        raise TypeError("sources must be a sequence of PagedSource / Int2Source (wrap a single source in a list)")
    if not sources:
        raise ValueError("a decode step needs at least one source")
    first_fp = next((s for s in sources if isinstance(s, PagedSource)), None)
    like = first_fp.key_pool if first_fp is not None else query
    groups: list[LaunchGroup] = []
    for source in sources:
        if isinstance(source, PagedSource):
            groups.append(LaunchGroup(source))
        elif isinstance(source, Int2Source):
            if not source.rotated and groups and groups[-1].int2 is None:
                groups[-1] = LaunchGroup(groups[-1].fp, source)
            else:
                empty = PagedSource.empty(source.table.shape[0], query.shape[-1], like.dtype, like.device)
                groups.append(LaunchGroup(empty, source))
        else:
            raise TypeError(f"a decode source is a PagedSource or an Int2Source, got {type(source).__name__}")
    return groups


@dataclass(frozen=True)
class TritonLaunch:
    """How the Triton path launches (the PyTorch reference ignores it).

    ``num_splits``: splits per row (None: enough (row, split) programs to fill the device);
    ``tile``: kv entries per loop step, a power of two >= 16 (None: ``paged_triton.decode_tile``,
    the tiles that compile without register spills); ``merge``: where the splits of a step read
    by one launch in the channel basis are combined, ``"kernel"`` (the merge kernel) or
    ``"torch"`` (float32 PyTorch ops, as always for several launches).
    """

    num_splits: int | None = None
    tile: int | None = None
    merge: str = "kernel"

    def __post_init__(self) -> None:
        if self.merge not in ("kernel", "torch"):
            raise ValueError(f"merge must be 'kernel' or 'torch', got {self.merge!r}")
