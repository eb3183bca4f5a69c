"""Attention kernels over the paged KV store and its INT2 tier (see docs/kernels.md).

Decode: ``paged_decode_attention(query, sources, ...)``, one softmax over a step's sources given as
dataclasses (``PagedSource``: FP pages; ``Int2Source``: INT2 windows with their grids, slot mask and
basis), with a pure PyTorch reference (``paged_decode_attention_torch``) and a Triton kernel
(``paged_triton``, imported lazily so CPU installs never need triton; ``TritonLaunch`` sets its
splits, tile and merge). Prefill over a compressed cache: ``paged_prefill_attention`` (flash-attn
varlen on CUDA, PyTorch otherwise).
INT2 windows: ``quantize_keys``/``quantize_values`` and their inverses; ``quantize_keys_compact``
with ``decode_key_grid`` for the compact (8-bit) key grid; ``hadamard_basis`` for windows quantized
in a Walsh-Hadamard basis.
"""

if __name__ != "vlm_kv.kernels":
    # This folder installs as vlm_kv.kernels (pyproject's package-dir). Python finds it as a top-level
    # `kernels` only when the repository root is on sys.path (`python -m ...` / `python -c` run from
    # the checkout), where it would stand in for the unrelated `kernels` distribution transformers
    # probes for, and importing vlm_kv from here would re-enter transformers half-way through its own
    # import. So hand the import to that distribution when one is installed, and otherwise stay an
    # empty module without a version, which transformers reads as "kernels not installed".
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _elsewhere = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _checkout]
    _spec = _machinery.PathFinder.find_spec(__name__, _elsewhere)
    if _spec is not None and _spec.loader is not None:
        _module = _util.module_from_spec(_spec)
        _sys.modules[__name__] = _module  # what `import kernels` returns once this file has run
        _spec.loader.exec_module(_module)
else:
    from vlm_kv.kernels.dispatch import (
        paged_decode_attention,
        resolve_backend,
        triton_available,
    )
    from vlm_kv.kernels.int2 import (
        decode_key_grid,
        dequantize_keys,
        dequantize_values,
        hadamard_basis,
        int2_window_bytes,
        pack_int2,
        quantize_keys,
        quantize_keys_compact,
        quantize_values,
        unpack_int2,
    )
    from vlm_kv.kernels.paged_torch import (
        mixed_attention_weights_torch,
        paged_decode_attention_torch,
    )
    from vlm_kv.kernels.sources import Int2Source, PagedSource, TritonLaunch
    from vlm_kv.kernels.varlen_prefill import (
        flash_attn_available,
        pack_paged_prefill,
        paged_prefill_attention,
        paged_prefill_attention_torch,
        unpack_prefill_output,
    )

    __all__ = [
        "paged_decode_attention", "paged_decode_attention_torch", "mixed_attention_weights_torch",
        "PagedSource", "Int2Source", "TritonLaunch",
        "resolve_backend", "triton_available",
        "quantize_keys", "quantize_values", "dequantize_keys", "dequantize_values",
        "quantize_keys_compact", "decode_key_grid", "hadamard_basis",
        "pack_int2", "unpack_int2", "int2_window_bytes",
        "paged_prefill_attention", "paged_prefill_attention_torch", "pack_paged_prefill", "unpack_prefill_output",
        "flash_attn_available",
    ]
