"""KIVI-style asymmetric 2-bit quantization of KV windows (the INT2 tier of QEvict).

Min-max grid per group: ``scale = (max - min) / 3``, ``zero = min``,
``code = clamp(round((x - zero) / scale), 0, 3)``, dequantized as ``code * scale + zero``.
Groups follow KIVI: keys per channel over a window of ``w`` tokens (keys have outlier
channels), values per token over head_dim. Scale and zero are stored in float16 and the codes
are computed from the stored (rounded) grid: zero is rounded down and scale up so that the grid
still covers [min, max], which keeps every element within ``scale / 2`` of its dequantized value.

Packing: four codes per byte along head_dim, channel ``d`` in bits ``2 * (d % 4)`` and
``2 * (d % 4) + 1`` of byte ``d // 4``; the Triton kernel unpacks the same way.
"""

from __future__ import annotations

import torch

CODE_MAX = 3  # 2 bits
_FP16_MAX = torch.finfo(torch.float16).max


def pack_int2(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] uint8 codes in 0..3 -> [..., D // 4] uint8, four codes per byte."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] % 4:
        raise ValueError(f"last dim {codes.shape[-1]} must be a multiple of 4 to pack four codes per byte")
    if codes.numel() and int(codes.max()) > CODE_MAX:
        raise ValueError(f"codes must be in 0..{CODE_MAX}, got {int(codes.max())}")
    c = codes.view(*codes.shape[:-1], codes.shape[-1] // 4, 4)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def unpack_int2(packed: torch.Tensor) -> torch.Tensor:
    """[..., D // 4] uint8 -> [..., D] uint8 codes (inverse of ``pack_int2``)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    codes = (packed[..., None] >> shifts) & CODE_MAX
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 4)


def _grid(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 (scale, zero) with zero <= lo and zero + 3 * scale >= hi in float32 arithmetic."""
    if not (bool(torch.isfinite(lo).all()) and bool(torch.isfinite(hi).all())):
        raise ValueError("INT2 quantization got non-finite values")
    if lo.numel() and max(float(lo.abs().amax()), float(hi.abs().amax())) > _FP16_MAX:
        raise ValueError(f"INT2 quantization stores zero in float16: values beyond +-{_FP16_MAX} cannot be represented")
    zero = lo.to(torch.float16)
    zero = torch.where(zero.float() > lo, fp16_step_down(zero), zero)
    scale = ((hi - zero.float()) / CODE_MAX).to(torch.float16)
    short = zero.float() + CODE_MAX * scale.float() < hi
    scale = torch.where(short, fp16_step_up(scale), scale)
    return scale, zero


def fp16_step_down(x: torch.Tensor) -> torch.Tensor:
    """The next float16 below each (finite) element, by its bit pattern (``torch.nextafter`` has
    no float16 kernel on every device)."""
    bits = x.view(torch.int16)
    negative_zero_step = torch.tensor(-32767, dtype=torch.int16, device=x.device)  # 0x8001: -smallest subnormal
    # Viewed as int16, a positive float's pattern steps down by -1; a negative float (sign bit
    # set) is a negative int whose magnitude field grows by +1; both zeros step to -subnormal.
    stepped = torch.where(bits > 0, bits - 1, torch.where(bits < 0, bits + 1, negative_zero_step))
    return torch.where(bits == -32768, negative_zero_step, stepped).view(torch.float16)


def fp16_step_up(x: torch.Tensor) -> torch.Tensor:
    """The next float16 above each non-negative finite element (scales are never negative)."""
    bits = x.view(torch.int16)
    return torch.where(bits == -32768, torch.ones_like(bits), bits + 1).view(torch.float16)


def _codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))  # constant group: every code 0 gives zero
    return torch.clamp(torch.round((x - zero.float()) / safe), 0, CODE_MAX).to(torch.uint8)


def quantize_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys of windows [n, w, D] -> (codes [n, w, D // 4] uint8, scale [n, D] fp16, zero [n, D] fp16).

    One group per (window, channel): min and max over the window's w tokens.
    """
    if keys.dim() != 3:
        raise ValueError(f"keys must be [num_windows, w, head_dim], got {tuple(keys.shape)}")
    x = keys.float()
    scale, zero = _grid(x.amin(dim=1), x.amax(dim=1))
    return pack_int2(_codes(x, scale[:, None, :], zero[:, None, :])), scale, zero


def quantize_values(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values of windows [n, w, D] -> (codes [n, w, D // 4] uint8, scale [n, w] fp16, zero [n, w] fp16).

    One group per token: min and max over head_dim.
    """
    if values.dim() != 3:
        raise ValueError(f"values must be [num_windows, w, head_dim], got {tuple(values.shape)}")
    x = values.float()
    scale, zero = _grid(x.amin(dim=2), x.amax(dim=2))
    return pack_int2(_codes(x, scale[:, :, None], zero[:, :, None])), scale, zero


_BYTE_TO_CODES: dict[torch.device, torch.Tensor] = {}


def unpack_int2_float(packed: torch.Tensor) -> torch.Tensor:
    """[..., D // 4] uint8 -> [..., D] float32 codes, through a 256 x 4 lookup table (one gather,
    faster on CPU than shifting and masking)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    table = _BYTE_TO_CODES.get(packed.device)
    if table is None:
        shifts = torch.tensor([0, 2, 4, 6], device=packed.device)
        table = ((torch.arange(256, device=packed.device)[:, None] >> shifts) & CODE_MAX).float()
        _BYTE_TO_CODES[packed.device] = table
    return table.index_select(0, packed.reshape(-1).long()).view(*packed.shape[:-1], packed.shape[-1] * 4)


def dequantize_keys(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(codes [..., w, D // 4], scale/zero [..., D]) -> keys [..., w, D] float32."""
    return torch.addcmul(zero.float().unsqueeze(-2), unpack_int2_float(codes), scale.float().unsqueeze(-2))


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(codes [..., w, D // 4], scale/zero [..., w]) -> values [..., w, D] float32."""
    return torch.addcmul(zero.float().unsqueeze(-1), unpack_int2_float(codes), scale.float().unsqueeze(-1))


def int2_window_bytes(window: int, head_dim: int) -> int:
    """Bytes one window of one kv head holds: K and V codes plus fp16 scale and zero for both."""
    return 2 * window * head_dim // 4 + 2 * 2 * head_dim + 2 * 2 * window
