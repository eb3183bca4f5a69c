"""One entry point per attention kind, choosing a backend by device and availability.

Decode: ``paged_decode_attention(query, sources, ...)`` over ``vlm_kv.kernels.sources`` dataclasses,
with the PyTorch reference (``paged_torch``) or the Triton kernels (``paged_triton``) behind it; the
runtime (``vlm_kv.attention.backend``) calls it too. Prefill: ``varlen_prefill.paged_prefill_attention``.

``backend="auto"`` picks Triton for CUDA tensors when triton imports, PyTorch otherwise (CPU
tensors always get PyTorch under "auto": the Triton interpreter is a test tool, not a fast
path). Asking for a backend that cannot run raises instead of silently running another one.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from functools import lru_cache
from typing import Literal

import torch

from vlm_kv.kernels.paged_torch import paged_decode_attention_torch
from vlm_kv.kernels.sources import Source, TritonLaunch

Backend = Literal["auto", "torch", "triton"]
_BACKENDS = ("auto", "torch", "triton")


@lru_cache(maxsize=None)
def _triton_import_error() -> str | None:
    try:
        importlib.import_module("triton")
        importlib.import_module("vlm_kv.kernels.paged_triton")
    except Exception as exc:  # ImportError, or triton failing to initialise its backend
        return f"{type(exc).__name__}: {exc}"
    return None


def triton_available() -> bool:
    """True when triton and our kernels import (says nothing about the device)."""
    return _triton_import_error() is None


def _triton_can_run(device: torch.device) -> tuple[bool, str]:
    error = _triton_import_error()
    if error is not None:
        return False, f"triton is not importable ({error}); install the 'gpu' extra"
    # lazy: vlm_kv.kernels.paged_triton imports triton, which is optional
    from vlm_kv.kernels import paged_triton

    if device.type == "cuda" or paged_triton.INTERPRETED:
        return True, ""
    return False, f"the Triton kernels need CUDA tensors, got {device} (TRITON_INTERPRET=1 runs them on CPU for tests)"


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend ("torch" or "triton") for a request; raises when it cannot run."""
    if backend not in _BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {_BACKENDS}")
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return "torch"  # "auto" on CPU never imports triton (importing it fixes interpreter mode for good)
    ok, why = _triton_can_run(device)
    if backend == "triton":
        if not ok:
            raise RuntimeError(f"backend='triton' cannot run: {why}")
        return "triton"
    return "triton" if ok else "torch"


def paged_decode_attention(
    query: torch.Tensor,
    sources: Sequence[Source],
    *,
    scaling: float | None = None,
    backend: str = "auto",
    validate: bool = True,
    launch: TritonLaunch | None = None,
) -> torch.Tensor:
    """Decode attention of ``query`` [B, Hq, D] over a step's ``sources`` in one softmax, with the
    chosen backend; returns [B, Hq, D] in the query dtype.

    ``sources``: ``PagedSource`` (FP pages) and ``Int2Source`` (INT2 windows, with their slot mask
    and basis) of the same rows, in the order their entries are laid out. ``scaling`` None:
    ``head_dim ** -0.5``. ``validate`` also reads the tables (a host sync on CUDA); a store that
    keeps its own invariants passes False. ``launch``: the Triton path's splits, tile and merge
    (``TritonLaunch``), ignored by the PyTorch reference.
    """
    if resolve_backend(backend, query.device) == "triton":
        # lazy: vlm_kv.kernels.paged_triton imports triton, which is optional
        from vlm_kv.kernels.paged_triton import paged_decode_attention_triton

        return paged_decode_attention_triton(query, sources, scaling, validate, launch)
    return paged_decode_attention_torch(query, sources, scaling, validate)
