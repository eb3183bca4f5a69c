"""The compiled paths: the only caller of ``vlm_kv.kernels`` (Triton decode, varlen prefill).

The store's body and tail and the INT2 tier's windows go to the kernels' public API as
``vlm_kv.kernels.sources`` dataclasses; the Triton module is imported by the API when first used,
so the runtime loads without Triton."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from vlm_kv.kernels import int2_cpu
from vlm_kv.kernels.dispatch import paged_decode_attention, resolve_backend
from vlm_kv.kernels.sources import Int2Source, PagedSource, TritonLaunch
from vlm_kv.kernels.varlen_prefill import flash_attn_available, paged_prefill_attention

# The cache has always combined its sources' partials in float32 PyTorch ops, also for a step read by
# one launch (a body-less store): the merge kernel would move its last bits and launch a variant the
# AOT census (vlm_kv.eval.kernel_census) does not list.
_CACHE_LAUNCH = TritonLaunch(merge="torch")


def _body_source(store: Any) -> PagedSource:
    """The store's body read in place as a paged source with one-entry blocks."""
    return PagedSource(*store.paged_body())


def _tail_source(store: Any) -> PagedSource:
    """The store's buffer of recent tokens read in place as a paged source with one-entry blocks."""
    return PagedSource(*store.paged_tail())


def _int2_source(tier: Any) -> Int2Source:
    """The tier's active windows as the kernels read them: ``Int2Tier.kernel_pools`` (codes, grids,
    window table and counts, then the slot mask when a window has holes) and the tier's basis."""
    pools = tier.kernel_pools()
    return Int2Source(*pools[:8], slot_mask=pools[8] if len(pools) > 8 else None,
                      key_basis=tier.key_basis, value_basis=tier.value_basis)


def decode_attention_triton(query: torch.Tensor, store: Any, scaling: float | None) -> torch.Tensor:
    """``decode_attention`` through the Triton paged decode kernel: the body is read in place as a
    paged store with one-entry blocks, the tail buffer likewise; one softmax over both. [B, 1, Hq, D]."""
    b, hq, _, d = query.shape
    sources = [_body_source(store)] if store.body_size else []
    sources.append(_tail_source(store))
    out = paged_decode_attention(query[:, :, 0].contiguous(), sources, scaling=scaling, backend="triton",
                                 validate=False, launch=_CACHE_LAUNCH)
    return out.view(b, 1, hq, d)


def tiered_decode_attention_triton(query: torch.Tensor, store: Any, tier: Any, scaling: float | None) -> torch.Tensor:
    """Decode over a store and its INT2 tier through the Triton kernel: body (one-entry blocks) with
    the packed INT2 windows, then the tail, in one softmax; the kernel reads the 2-bit codes
    directly. Windows in a Hadamard basis are read in a launch of their own, with the rotated
    query (``vlm_kv.kernels.sources.launch_plan``). [B, 1, Hq, D]."""
    b, hq, _, d = query.shape
    rows = store.batch_size * store.num_kv_heads
    keys = store.body_keys
    body = _body_source(store) if store.body_size else PagedSource.empty(rows, keys.shape[-1], keys.dtype, keys.device)
    sources = [body, _int2_source(tier), _tail_source(store)]
    out = paged_decode_attention(query[:, :, 0].contiguous(), sources, scaling=scaling, backend="triton",
                                 validate=False, launch=_CACHE_LAUNCH)
    return out.view(b, 1, hq, d)


def prefill_attention_paged(query: torch.Tensor, store: Any, scaling: float | None, backend: str = "auto") -> torch.Tensor:
    """Several new queries (a new turn, a prefill chunk) over a compressed store through the varlen
    prefill path of ``vlm_kv.kernels`` (flash-attn's varlen function on CUDA): each (batch, kv head)
    row is one sequence of its kept entries followed by the tail, the new tokens last, causal from
    the bottom right. Needs a tail without padding. Returns [B, Q, Hq, D]."""

    d = query.shape[-1]
    rows, T = store.batch_size * store.num_kv_heads, store.tail_size
    # one transient pool: body, then each row's tail (a working copy, as for the padded view)
    keys = torch.cat([store.body_keys, store.tail_keys.reshape(rows * T, d)])
    values = torch.cat([store.body_values, store.tail_values.reshape(rows * T, d)])
    cols = torch.arange(store.max_length + T, device=query.device)[None, :]
    body_part = store.row_starts[:, None] + cols
    tail_part = store.body_size + torch.arange(rows, device=query.device)[:, None] * T + (cols - store.lengths[:, None])
    table = torch.where(cols < store.lengths[:, None], body_part, tail_part)
    table = table.clamp(0, max(keys.shape[0] - 1, 0)).to(torch.int32)
    lengths = (store.lengths + T).to(torch.int32)
    pages = PagedSource(keys.view(-1, 1, d), values.view(-1, 1, d), table, lengths)
    out = paged_prefill_attention(query, pages, scaling=scaling, causal=True, backend=backend, validate=False)
    return out.transpose(1, 2)


@dataclass(frozen=True)
class PackedWindows:
    """One sequence's active INT2 windows as stored, grouped by KV head, for the CPU kernel
    (``vlm_kv.kernels.int2_cpu``): nothing is decoded or expanded.

    ``key_codes`` / ``value_codes`` [n, w, D // 4] uint8; the keys' grid as the tier stores it
    (``key_scale`` / ``key_zero`` [n, D] fp16, or the compact grid's uint8 codes with ``key_ref``
    [n, 3] fp16; [n, 0] for fp16 grids); ``value_scale`` / ``value_zero`` [n, w] fp16;
    ``head_windows`` [H] int64 windows of each KV head, in order; ``holes`` [n, w] bool or None."""

    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_zero: torch.Tensor
    key_ref: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_zero: torch.Tensor
    head_windows: torch.Tensor
    holes: torch.Tensor | None = None


def tiered_decode_attention_cpu(query: torch.Tensor, store: Any, windows: list[PackedWindows],
                                key_basis: torch.Tensor | None, value_basis: torch.Tensor | None,
                                scaling: float | None) -> torch.Tensor:
    """Decode over a store and its INT2 windows (``windows[b]``: sequence b's, from
    ``Int2Tier.packed_windows``) through the C++ kernel, one call per sequence; the INT2 share is
    rotated back out of the values' basis here. As ``decode.decode_attention_with_rotated``, which
    it is checked against. [B, 1, Hq, D] in the query's dtype."""
    b, hq, _, d = query.shape
    h = store.num_kv_heads
    scale = scaling if scaling is not None else d ** -0.5
    q = query.reshape(b, hq, d).float()
    rotated = q if key_basis is None else q @ key_basis
    tail_k, tail_v = store.tail_keys.float(), store.tail_values.float()
    tail_valid = store.tail_valid
    outs = []
    for i in range(b):
        start, count = store.batch_span(i)
        body = (store.body_keys[start : start + count].float(), store.body_values[start : start + count].float(),
                store.lengths[i * h : (i + 1) * h])
        tail = (tail_k[i].contiguous(), tail_v[i].contiguous(), tail_valid[i].contiguous())  # a view of the buffer
        fp, quantized = int2_cpu.tiered_decode(q[i], rotated[i], body, tail, windows[i], hq // h, scale)
        outs.append(fp + (quantized if value_basis is None else quantized @ value_basis.T))
    return torch.stack(outs).view(b, 1, hq, d).to(query.dtype)


class AttentionPaths:
    """The attention backend a cache was built with ("auto", "torch" or "triton"), resolved lazily:
    the first decode step decides whether decode runs the Triton kernel (CUDA + triton for "auto")."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._triton_decode: bool | None = None
        self._cpu_int2: bool | None = None

    def triton_decode(self, query: torch.Tensor) -> bool:
        """Whether decode steps run the Triton paged kernel (resolved once, on the first call)."""
        if self._triton_decode is None:
            if self.backend == "torch":
                self._triton_decode = False
            else:
                self._triton_decode = resolve_backend(self.backend, query.device) == "triton"
        return self._triton_decode

    def cpu_int2_decode(self, query: torch.Tensor) -> bool:
        """Whether tiered decode steps on CPU attend the INT2 windows through the C++ kernels
        (``vlm_kv.kernels.int2_cpu``): "auto" on CPU when they build (once; otherwise a warning
        and the PyTorch path), never for "torch" (the pure PyTorch path) or "triton"."""
        if self._cpu_int2 is None:
            self._cpu_int2 = False
            if self.backend == "auto" and query.device.type == "cpu":
                try:
                    int2_cpu.load()
                    self._cpu_int2 = True
                except int2_cpu.CpuKernelUnavailable as err:
                    warnings.warn(f"{err}; tiered decode runs the PyTorch path", RuntimeWarning, stacklevel=2)
        return self._cpu_int2

    def flash_prefill(self, query: torch.Tensor) -> bool:
        """Whether a prefill over a compressed store runs flash-attn's varlen function (CUDA, fp16/bf16)."""
        if self.backend == "torch" or query.device.type != "cuda" or query.dtype not in (torch.float16, torch.bfloat16):
            return False
        return flash_attn_available()
