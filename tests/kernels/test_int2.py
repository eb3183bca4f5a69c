import pytest
import torch

from vlm_kv.kernels.int2 import (
    dequantize_keys,
    dequantize_values,
    hadamard_basis,
    int2_basis,
    int2_window_bytes,
    pack_int2,
    quantize_keys,
    quantize_values,
    unpack_int2,
)


def _windows(dtype, seed=0, n=5, w=8, d=32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, w, d, generator=gen) * torch.linspace(0.1, 20, d)  # outlier channels
    return (x + 3 * torch.randn(n, 1, 1, generator=gen)).to(dtype)


def _tol(scale):
    # fp32 rounding of code * scale + zero on top of the half-step bound
    return scale.float() / 2 * (1 + 1e-3) + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_error_within_half_step_per_channel(dtype):
    keys = _windows(dtype)
    codes, scale, zero = quantize_keys(keys)
    assert codes.shape == (5, 8, 8) and codes.dtype == torch.uint8
    assert scale.shape == (5, 32) and zero.shape == (5, 32)
    assert scale.dtype == torch.float16 and zero.dtype == torch.float16
    err = (dequantize_keys(codes, scale, zero) - keys.float()).abs()
    assert bool((err <= _tol(scale)[:, None, :]).all())
    # the grid covers each channel's range over the window's tokens
    assert bool((zero.float() <= keys.float().amin(dim=1)).all())
    assert bool((zero.float() + 3 * scale.float() >= keys.float().amax(dim=1)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_error_within_half_step_per_token(dtype):
    values = _windows(dtype, seed=1)
    codes, scale, zero = quantize_values(values)
    assert scale.shape == (5, 8) and zero.shape == (5, 8)
    err = (dequantize_values(codes, scale, zero) - values.float()).abs()
    assert bool((err <= _tol(scale)[:, :, None]).all())
    assert bool((zero.float() <= values.float().amin(dim=2)).all())
    assert bool((zero.float() + 3 * scale.float() >= values.float().amax(dim=2)).all())


def test_groups_are_channels_for_keys_and_tokens_for_values():
    x = _windows(torch.float32, seed=2)
    y = x.clone()
    y[1, 3, 7] += 100.0  # one element of window 1, token 3, channel 7
    _, ks_x, kz_x = quantize_keys(x)
    _, ks_y, kz_y = quantize_keys(y)
    changed = (ks_x != ks_y) | (kz_x != kz_y)
    assert changed.nonzero().tolist() == [[1, 7]]  # only that window's channel 7
    _, vs_x, vz_x = quantize_values(x)
    _, vs_y, vz_y = quantize_values(y)
    changed = (vs_x != vs_y) | (vz_x != vz_y)
    assert changed.nonzero().tolist() == [[1, 3]]  # only that window's token 3


def test_extremes_map_to_codes_zero_and_three():
    keys = torch.zeros(1, 4, 4)
    keys[0, :, 0] = torch.tensor([0.0, 1.0, 2.0, 3.0])
    codes, scale, zero = quantize_keys(keys)
    assert unpack_int2(codes)[0, :, 0].tolist() == [0, 1, 2, 3]
    assert float(scale[0, 0]) == 1.0 and float(zero[0, 0]) == 0.0
    # a constant channel quantizes to code 0 and dequantizes to its value
    assert unpack_int2(codes)[0, :, 1].tolist() == [0, 0, 0, 0]
    assert bool((dequantize_keys(codes, scale, zero)[0, :, 1] == 0).all())


def test_pack_unpack_round_trip_and_bit_order():
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 4, (3, 8, 64), generator=gen, dtype=torch.uint8)
    packed = pack_int2(codes)
    assert packed.shape == (3, 8, 16) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int2(packed), codes)
    # channel d lives in bits 2*(d%4).. of byte d//4
    one = pack_int2(torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8))
    assert one.tolist() == [[1 | 2 << 2 | 3 << 4]]


def test_bad_input_raises():
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_int2(torch.zeros(2, 6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..3"):
        pack_int2(torch.full((4,), 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        pack_int2(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="non-finite"):
        quantize_keys(torch.full((1, 2, 4), float("nan")))
    with pytest.raises(ValueError, match="float16"):
        quantize_values(torch.full((1, 2, 4), 1e6))
    with pytest.raises(ValueError, match="num_windows"):
        quantize_keys(torch.zeros(2, 4))


def test_window_bytes_match_the_spec_formula():
    # spec: b_q = H*D*w/2 + 4*H*D + 4*H*w per layer, here for one kv head
    for w, d in ((8, 64), (16, 128), (1, 4)):
        assert int2_window_bytes(w, d) == d * w // 2 + 4 * d + 4 * w
        codes, ks, kz = quantize_keys(torch.randn(1, w, d))
        vcodes, vs, vz = quantize_values(torch.randn(1, w, d))
        assert sum(t.numel() * t.element_size() for t in (codes, ks, kz, vcodes, vs, vz)) == int2_window_bytes(w, d)


def test_float_unpacking_matches_bitwise_unpacking():
    from vlm_kv.kernels.int2 import unpack_int2_float

    packed = torch.arange(256, dtype=torch.uint8).view(16, 16)
    assert torch.equal(unpack_int2_float(packed), unpack_int2(packed).float())


def test_fp16_steps_match_nextafter_on_every_float16():
    from vlm_kv.kernels.int2 import fp16_step_down, fp16_step_up

    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    finite = torch.isfinite(x)
    down = torch.nextafter(x, torch.full_like(x, -float("inf")))
    assert torch.equal(fp16_step_down(x)[finite].view(torch.int16), down[finite].view(torch.int16))
    up = torch.nextafter(x, torch.full_like(x, float("inf")))
    nonneg = finite & (x >= 0)
    assert torch.equal(fp16_step_up(x)[nonneg].view(torch.int16), up[nonneg].view(torch.int16))


# ---- compact key grid (key_grid="int8")

from vlm_kv.kernels.int2 import decode_key_grid, quantize_keys_compact  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compact_key_grid_keeps_the_half_step_bound_and_covers_every_channel(dtype):
    keys = _windows(dtype, seed=4, n=40, d=64)
    codes, zc, sc, ref = quantize_keys_compact(keys)
    assert codes.shape == (40, 8, 16) and zc.shape == sc.shape == (40, 64)
    assert zc.dtype == sc.dtype == torch.uint8 and ref.shape == (40, 3) and ref.dtype == torch.float16
    scale, zero = decode_key_grid(zc, sc, ref)
    x = keys.float()
    assert bool((zero <= x.amin(dim=1)).all()) and bool((zero + 3 * scale >= x.amax(dim=1)).all())
    err = (dequantize_keys(codes, scale, zero) - x).abs()
    assert bool((err <= _tol(scale)[:, None, :]).all())


def test_compact_key_grid_costs_little_accuracy_against_the_fp16_grid():
    keys = _windows(torch.float32, seed=5, n=200, d=64)
    c16, s16, z16 = quantize_keys(keys)
    c8, zc, sc, ref = quantize_keys_compact(keys)
    mse16 = float(((dequantize_keys(c16, s16, z16) - keys) ** 2).mean())
    mse8 = float(((dequantize_keys(c8, *decode_key_grid(zc, sc, ref)) - keys) ** 2).mean())
    assert mse16 <= mse8 <= 1.05 * mse16  # coarser grid levels, within 5 % of the fp16 grid's error


def test_compact_key_grid_of_constant_and_empty_windows():
    const = torch.full((3, 8, 16), -2.5)
    codes, zc, sc, ref = quantize_keys_compact(const)
    assert torch.equal(dequantize_keys(codes, *decode_key_grid(zc, sc, ref)), const)
    codes, zc, sc, ref = quantize_keys_compact(torch.zeros(0, 8, 16))
    assert codes.shape == (0, 8, 4) and zc.shape == (0, 16) and ref.shape == (0, 3)
    with pytest.raises(ValueError, match="non-finite"):
        quantize_keys_compact(torch.full((1, 2, 4), float("inf")))
    with pytest.raises(ValueError, match="float16"):
        quantize_keys_compact(torch.full((1, 2, 4), 1e6))


def test_compact_window_bytes_match_the_stored_tensors():
    for w, d in ((8, 64), (16, 128), (1, 4)):
        assert int2_window_bytes(w, d, "int8") == d * w // 2 + 2 * d + 6 + 4 * w
        codes, zc, sc, ref = quantize_keys_compact(torch.randn(1, w, d))
        vcodes, vs, vz = quantize_values(torch.randn(1, w, d))
        stored = sum(t.numel() * t.element_size() for t in (codes, zc, sc, ref, vcodes, vs, vz))
        assert stored == int2_window_bytes(w, d, "int8")
    assert int2_window_bytes(8, 64, "int8") == 422 and int2_window_bytes(8, 64) == 544
    with pytest.raises(ValueError, match="key_grid"):
        int2_window_bytes(8, 64, "int4")


@pytest.mark.parametrize("head_dim, block", [(64, 64), (128, 128), (96, 32), (80, 16), (4, 4)])
def test_hadamard_basis_is_orthonormal_symmetric_and_block_diagonal(head_dim, block):
    h = hadamard_basis(head_dim)
    assert h.shape == (head_dim, head_dim) and h.dtype == torch.float32
    torch.testing.assert_close(h @ h, torch.eye(head_dim), rtol=0, atol=1e-6)
    assert torch.equal(h, h.T)
    assert bool((h.abs()[:block, :block] == block ** -0.5).all())  # a full Walsh-Hadamard block
    if block < head_dim:
        assert bool((h[:block, block:] == 0).all())


def test_int2_basis_names():
    assert int2_basis("channel", 64) == (None, None)
    keys, values = int2_basis("hadamard", 64)
    assert torch.equal(keys, hadamard_basis(64)) and torch.equal(values, hadamard_basis(64))
    keys, values = int2_basis("hadamard_keys", 64)
    assert torch.equal(keys, hadamard_basis(64)) and values is None
    with pytest.raises(ValueError, match="basis must be one of"):
        int2_basis("pca", 64)


def test_hadamard_basis_spreads_an_outlier_channel_and_cuts_the_value_error():
    # values are grouped per token: one outlier channel stretches the token's grid for all others
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(64, 8, 64, generator=gen)
    values[..., 5] += 30.0
    h = hadamard_basis(64)
    plain = dequantize_values(*quantize_values(values))
    rotated = dequantize_values(*quantize_values(values @ h)) @ h
    err_plain, err_rot = (plain - values).pow(2).mean(), (rotated - values).pow(2).mean()
    assert err_rot < 0.5 * err_plain
    # the rotated codes keep the half-step bound in the rotated basis, so the error norm is bounded per token
    _, scale, _ = quantize_values(values @ h)
    bound = (scale.float() / 2 * (1 + 1e-3) + 1e-6) * 64 ** 0.5
    assert bool(((rotated - values).norm(dim=-1) <= bound).all())
