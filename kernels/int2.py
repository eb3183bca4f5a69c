"""KIVI-style asymmetric 2-bit quantization of KV windows (the INT2 tier of QEvict).

Min-max grid per group: ``scale = (max - min) / 3``, ``zero = min``,
``code = clamp(round((x - zero) / scale), 0, 3)``, dequantized as ``code * scale + zero``.
Groups follow KIVI: keys per channel over a window of ``w`` tokens (keys have outlier
channels), values per token over head_dim. Scale and zero are stored in float16 and the codes
are computed from the stored (rounded) grid: zero is rounded down and scale up so that the grid
still covers [min, max], which keeps every element within ``scale / 2`` of its dequantized value.

Compact key grid (``key_grid="int8"``, ours; the paper keeps fp16): a window's per-channel zeros
and scales are themselves stored as 8-bit codes against three fp16 references per window
(``zero_c = z_lo + zc * z_step``, ``scale_c = sc * s_step``), which halves the key grid, the
largest part of an INT2 window in bf16 (256 of 544 bytes at w = 8, head_dim = 64). The decoded
grid is computed in float32 and the key codes against it, with zero still at or below the min and
``zero + 3 * scale`` at or above the max, so the ``scale / 2`` bound holds for the decoded scale.

Hadamard basis (``basis="hadamard"``, ours; the paper quantizes in the channel basis; ``"hadamard_keys"``
rotates the keys only): keys and values are quantized as ``x @ H``, with ``H`` an orthonormal, symmetric Walsh-Hadamard matrix
(block-diagonal with the largest power-of-two block dividing head_dim), and dequantized back as
``x' @ H``. The rotation spreads a token's outlier channels over all channels, so the per-token value
grid is finer, and evens out the per-channel key ranges, before the same 2-bit grids apply. The
codes and bytes are unchanged; the kernels attend rotated codes with the query rotated the same way
(``q . k = (q H) . (k H)``) and rotate the INT2 part of the output back.

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
    _check_range(lo, hi)
    zero = lo.to(torch.float16)
    zero = torch.where(zero.float() > lo, fp16_step_down(zero), zero)
    scale = ((hi - zero.float()) / CODE_MAX).to(torch.float16)
    short = zero.float() + CODE_MAX * scale.float() < hi
    scale = torch.where(short, fp16_step_up(scale), scale)
    return scale, zero


def _check_range(lo: torch.Tensor, hi: torch.Tensor) -> None:
    """Group minima and maxima a float16 grid (or its float16 references) can hold."""
    if not (bool(torch.isfinite(lo).all()) and bool(torch.isfinite(hi).all())):
        raise ValueError("INT2 quantization got non-finite values")
    if lo.numel() and max(float(lo.abs().amax()), float(hi.abs().amax())) > _FP16_MAX:
        raise ValueError(f"INT2 quantization stores zero in float16: values beyond +-{_FP16_MAX} cannot be represented")


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


KEY_GRIDS = ("fp16", "int8")
_GRID_LEVELS = 255
INT2_BASES = ("channel", "hadamard", "hadamard_keys")
_HADAMARD: dict[tuple[int, torch.device], torch.Tensor] = {}


def hadamard_basis(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthonormal, symmetric [head_dim, head_dim] float32 Walsh-Hadamard matrix, block-diagonal
    with the largest power-of-two block that divides head_dim (so ``H @ H`` is the identity)."""
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    device = torch.device(device)
    found = _HADAMARD.get((head_dim, device))
    if found is None:
        block = head_dim & -head_dim  # largest power of two dividing head_dim
        h = torch.ones(1, 1)
        while h.shape[0] < block:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        found = torch.block_diag(*[h / block ** 0.5] * (head_dim // block)).to(device)
        _HADAMARD[(head_dim, device)] = found
    return found


def int2_basis(name: str, head_dim: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(keys', values') matrices INT2 windows of basis ``name`` are quantized in (None: the channel
    basis): ``"hadamard"`` rotates both, ``"hadamard_keys"`` the keys only."""
    if name not in INT2_BASES:
        raise ValueError(f"basis must be one of {INT2_BASES}, got {name!r}")
    h = hadamard_basis(head_dim, device) if name != "channel" else None
    return h, (h if name == "hadamard" else None)


def _up16(x: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 -> the nearest float16 at or above it (a step must not shrink the grid)."""
    h = x.to(torch.float16)
    return torch.where(h.float() < x, fp16_step_up(h), h)


def decode_key_grid(zero_codes: torch.Tensor, scale_codes: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compact grid (uint8 [n, D] zero and scale codes, fp16 [n, 3] (z_lo, z_step, s_step)) ->
    float32 (scale, zero) [n, D]."""
    r = ref.float()
    zero = r[:, 0:1] + zero_codes.float() * r[:, 1:2]
    scale = scale_codes.float() * r[:, 2:3]
    return scale, zero


def quantize_keys_compact(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys of windows [n, w, D] -> (codes [n, w, D // 4] uint8, zero codes [n, D] uint8,
    scale codes [n, D] uint8, references [n, 3] float16); decode with ``decode_key_grid``."""
    if keys.dim() != 3:
        raise ValueError(f"keys must be [num_windows, w, head_dim], got {tuple(keys.shape)}")
    x = keys.float()
    lo, hi = x.amin(dim=1), x.amax(dim=1)
    _check_range(lo, hi)
    n = x.shape[0]
    if n == 0:
        u8 = torch.empty(0, x.shape[2], dtype=torch.uint8, device=x.device)
        return pack_int2(torch.empty(0, x.shape[1], x.shape[2], dtype=torch.uint8, device=x.device)), u8, u8.clone(), \
            torch.empty(0, 3, dtype=torch.float16, device=x.device)
    z_lo = lo.amin(dim=1).to(torch.float16)
    z_lo = torch.where(z_lo.float() > lo.amin(dim=1), fp16_step_down(z_lo), z_lo)
    z_step = _up16((lo.amax(dim=1) - z_lo.float()) / _GRID_LEVELS)
    zs = z_step.float()[:, None]
    safe_z = torch.where(zs > 0, zs, torch.ones_like(zs))
    zc = torch.floor((lo - z_lo.float()[:, None]) / safe_z).clamp(0, _GRID_LEVELS)
    zc = torch.where(zs > 0, zc, torch.zeros_like(zc))
    zero = z_lo.float()[:, None] + zc * zs
    zc = torch.where(zero > lo, (zc - 1).clamp(min=0), zc)  # float rounding: keep zero <= min
    zero = z_lo.float()[:, None] + zc * zs
    need = (hi - zero) / CODE_MAX
    # one level of headroom, so that the correction below never needs a 256th level
    s_step = _up16(need.amax(dim=1) / (_GRID_LEVELS - 1))
    ss = s_step.float()[:, None]
    safe_s = torch.where(ss > 0, ss, torch.ones_like(ss))
    sc = torch.ceil(need / safe_s).clamp(0, _GRID_LEVELS)
    sc = torch.where(zero + CODE_MAX * (sc * ss) < hi, (sc + 1).clamp(max=_GRID_LEVELS), sc)
    sc = torch.where(ss > 0, sc, torch.zeros_like(sc))
    ref = torch.stack([z_lo, z_step, s_step], dim=1)
    zc8, sc8 = zc.to(torch.uint8), sc.to(torch.uint8)
    scale, zero = decode_key_grid(zc8, sc8, ref)
    return pack_int2(_codes(x, scale[:, None, :], zero[:, None, :])), zc8, sc8, ref


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


def int2_window_bytes(window: int, head_dim: int, key_grid: str = "fp16") -> int:
    """Bytes one window of one kv head holds: K and V codes, the keys' per-channel grid (fp16
    scale and zero, or with ``key_grid="int8"`` 8-bit codes of both plus three fp16 references)
    and the values' fp16 scale and zero per token."""
    if key_grid not in KEY_GRIDS:
        raise ValueError(f"key_grid must be one of {KEY_GRIDS}, got {key_grid!r}")
    key_grid_bytes = 2 * 2 * head_dim if key_grid == "fp16" else 2 * head_dim + 3 * 2
    return 2 * window * head_dim // 4 + key_grid_bytes + 2 * 2 * window
