"""One entry point per attention kind, choosing a backend by device and availability.

``backend="auto"`` picks Triton for CUDA tensors when triton imports, PyTorch otherwise (CPU
tensors always get PyTorch under "auto": the Triton interpreter is a test tool, not a fast
path). Asking for a backend that cannot run raises instead of silently running another one.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Literal

import torch

from vlm_kv.kernels.paged_torch import (
    mixed_decode_attention_torch,
    paged_decode_attention_torch,
)

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
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scaling: float | None,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Decode attention over the paged FP store with the chosen backend; returns [B, Hq, D]."""
    if resolve_backend(backend, query.device) == "triton":
        # lazy: vlm_kv.kernels.paged_triton imports triton, which is optional
        from vlm_kv.kernels.paged_triton import paged_decode_attention_triton

        return paged_decode_attention_triton(query, key_pool, value_pool, block_table, lengths, scaling, validate)
    return paged_decode_attention_torch(query, key_pool, value_pool, block_table, lengths, scaling, validate)


def mixed_decode_attention(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    int2_table: torch.Tensor,
    int2_counts: torch.Tensor,
    scaling: float | None,
    backend: str = "auto",
    validate: bool = True,
    slot_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One softmax over FP pages and INT2 windows with the chosen backend; returns [B, Hq, D].
    ``slot_mask`` [num_windows, w] bool: the attended slots of windows with holes (None: all)."""
    args = (query, key_pool, value_pool, block_table, lengths, key_codes, key_scale, key_zero,
            value_codes, value_scale, value_zero, int2_table, int2_counts, scaling)
    if resolve_backend(backend, query.device) == "triton":
        # lazy: vlm_kv.kernels.paged_triton imports triton, which is optional
        from vlm_kv.kernels.paged_triton import mixed_decode_attention_triton

        return mixed_decode_attention_triton(*args, validate=validate, slot_mask=slot_mask)
    return mixed_decode_attention_torch(*args, validate=validate, slot_mask=slot_mask)
