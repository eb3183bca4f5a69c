"""Attention kernels over the paged KV store and its INT2 tier (see docs/kernels.md).

Decode: ``paged_decode_attention`` (FP pages) and ``mixed_decode_attention`` (FP pages and
INT2 windows in one softmax), each with a pure PyTorch reference (``*_torch``) and a Triton
kernel (``*_triton``, imported lazily so CPU installs never need triton). Prefill over a
compressed cache: ``paged_prefill_attention`` (flash-attn varlen on CUDA, PyTorch otherwise).
INT2 windows: ``quantize_keys``/``quantize_values`` and their inverses; ``quantize_keys_compact``
with ``decode_key_grid`` for the compact (8-bit) key grid; ``hadamard_basis`` for windows quantized
in a Walsh-Hadamard basis.
"""

from vlm_kv.kernels.dispatch import (
    mixed_decode_attention,
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
    mixed_decode_attention_torch,
    paged_decode_attention_torch,
)
from vlm_kv.kernels.varlen_prefill import (
    flash_attn_available,
    pack_paged_prefill,
    paged_prefill_attention,
    paged_prefill_attention_torch,
    unpack_prefill_output,
)

__all__ = [
    "paged_decode_attention", "paged_decode_attention_torch",
    "mixed_decode_attention", "mixed_decode_attention_torch", "mixed_attention_weights_torch",
    "resolve_backend", "triton_available",
    "quantize_keys", "quantize_values", "dequantize_keys", "dequantize_values",
    "quantize_keys_compact", "decode_key_grid", "hadamard_basis",
    "pack_int2", "unpack_int2", "int2_window_bytes",
    "paged_prefill_attention", "paged_prefill_attention_torch", "pack_paged_prefill", "unpack_prefill_output",
    "flash_attn_available",
]
