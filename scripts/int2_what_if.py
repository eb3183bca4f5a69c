"""What-if runs of the INT2 tier: where its KL comes from (docs/tiers.md, session 8).

Runs ``python -m vlm_kv.eval.gate_cells`` with one part of the INT2 tier changed, to learn what
the next change should buy. None of these is a cache anyone should deploy; two of them break
the byte accounting on purpose (the reported ``kv_bytes`` then exceed the budget).

    python scripts/int2_what_if.py --charge 0.5 -- --dtype bfloat16 --text T --cell ...
        charge INT2 windows 0.5 of their real bytes while storing them as before: what a cheaper
        window format would buy at the same quantization noise
    python scripts/int2_what_if.py --exact keys|values|both -- ...
        attend the INT2 entries with their original full-precision keys and/or values (kept on
        the host through the spill tier) while charging INT2 bytes: the quantization noise alone
    python scripts/int2_what_if.py --key-block K -- ...
        fit one key grid per (row, K consecutive windows) of a routing event instead of one per
        window, charged at the amortized bytes with --charge: whether key grids can be shared
    python scripts/int2_what_if.py --fit mse[-keys|-values] -- ...
        grids over the least-squares clipped range instead of min-max (same bytes)
    python scripts/int2_what_if.py --hadamard keys|values|both -- ... (cells with basis=channel; keys: and key_rope=pre)
        quantize keys (after RoPE is undone) and/or values in a Walsh-Hadamard rotated basis and
        rotate back after dequantizing (same bytes): whether spreading outlier channels helps. Run
        in session 9 before ``basis="hadamard"`` existed; on a Hadamard-basis cache it would undo it
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

_CLIPS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25)


def _charge(factor: float) -> None:
    from vlm_kv.tiers.int2_tier import Int2Tier

    real = Int2Tier.window_bytes
    Int2Tier.window_bytes = lambda self: int(real(self) * factor)


def _exact(part: str) -> None:
    """INT2 entries attended with their original FP copies (spill tier on, host copies read back)."""
    import vlm_kv.api as api
    import vlm_kv.tiers.int2_tier as tier_module
    from vlm_kv.tiers.int2_tier import Int2Tier, TierView
    from vlm_kv.kernels.int2 import dequantize_values
    from vlm_kv.storage.store import PaddedView

    tier_config = api._tier_config

    def with_spill(*args, **kwargs):
        cfg = tier_config(*args, **kwargs)
        return dataclasses.replace(cfg, spill=True) if cfg is not None else None

    def view(self, states=(), with_values=True, dtype=None):
        dtype = dtype or self.dtype
        layout = self._layout()
        idx, c = layout.idx, self.codes
        host = idx.cpu()
        if part in ("keys", "both"):
            keys = self.spill.keys.index_select(0, host).to(self.device)
        else:
            keys = self._decode_keys(c.key_codes[idx], *c.key_grid(idx), self.positions[idx])
        if part in ("values", "both"):
            values = self.spill.values.index_select(0, host).to(self.device)
        else:
            values = tier_module._out_of(dequantize_values(c.value_codes[idx], c.value_scale[idx], c.value_zero[idx]),
                                          self.value_basis)
        lay = layout.placement.lay
        keys = lay(keys, 0, dtype)
        values = lay(values, 0, dtype) if with_values else keys[..., :0]
        padded = PaddedView(keys=keys, values=values, positions=layout.positions, modality=layout.modality,
                            valid=layout.valid, state={n: lay(self.state[n][idx], 0.0, torch.float32) for n in states})
        return TierView(padded, layout.slot)

    api._tier_config = with_spill
    Int2Tier.view = view
    Int2Tier.kernel_readable = property(lambda self: False)  # the view above, never the kernel


def _key_block(block: int) -> None:
    """One key grid per (row, ``block`` consecutive windows) among the windows quantized together."""
    import vlm_kv.tiers.entry_router as routing
    from vlm_kv.tiers.int2_tier import QuantizedWindows
    from vlm_kv.kernels import int2

    last = {}
    gather = routing.gather_windows

    def gather_and_remember(*args, **kwargs):
        win = gather(*args, **kwargs)
        last["win"] = win
        return win

    def quantize(cls, keys, values, key_grid="fp16"):
        win = last.pop("win")
        x = keys.float()
        group = win.row * (int(win.window_id.max()) + 1) + win.window_id // block
        _, inv = torch.unique(group, return_inverse=True)
        n, d = int(inv.max()) + 1, x.shape[-1]
        index = inv[:, None].expand(-1, d)
        lo = torch.full((n, d), float("inf")).scatter_reduce(0, index, x.amin(1), "amin")[inv]
        hi = torch.full((n, d), float("-inf")).scatter_reduce(0, index, x.amax(1), "amax")[inv]
        scale, zero = int2._grid(lo, hi)
        codes = int2.pack_int2(int2._codes(x, scale[:, None, :], zero[:, None, :]))
        vc, vs, vz = int2.quantize_values(values)
        return cls(codes, scale, zero, vc, vs, vz, torch.empty(len(codes), 0, dtype=torch.float16))

    routing.gather_windows = gather_and_remember
    QuantizedWindows.quantize = classmethod(quantize)


def _mse_range(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    from vlm_kv.kernels import int2

    lo, hi = x.amin(dim=dim), x.amax(dim=dim)
    r = hi - lo
    best = torch.full_like(lo, float("inf"))
    best_lo, best_hi = lo.clone(), hi.clone()
    for a in _CLIPS:
        for b in _CLIPS:
            cl, ch = lo + a * r, hi - b * r
            scale, zero = int2._grid(cl, ch)
            s, z = scale.float().unsqueeze(dim), zero.float().unsqueeze(dim)
            err = ((int2._codes(x, scale.unsqueeze(dim), zero.unsqueeze(dim)).float() * s + z - x) ** 2).sum(dim=dim)
            take = err < best
            best = torch.where(take, err, best)
            best_lo, best_hi = torch.where(take, cl, best_lo), torch.where(take, ch, best_hi)
    return best_lo, best_hi


def _fit(which: str) -> None:
    """Least-squares clipped ranges for the fp16 grids (keys, values or both)."""
    import vlm_kv.tiers.int2_tier as tier
    from vlm_kv.kernels import int2

    def keys_mse(keys):
        x = keys.float()
        scale, zero = int2._grid(*_mse_range(x, 1))
        return int2.pack_int2(int2._codes(x, scale[:, None, :], zero[:, None, :])), scale, zero

    def values_mse(values):
        x = values.float()
        scale, zero = int2._grid(*_mse_range(x, 2))
        return int2.pack_int2(int2._codes(x, scale[:, :, None], zero[:, :, None])), scale, zero

    if which in ("mse", "mse-keys"):
        tier.quantize_keys = keys_mse
    if which in ("mse", "mse-values"):
        tier.quantize_values = values_mse


def _hadamard_matrix(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if h.shape[0] != d:
        raise ValueError(f"--hadamard needs a power-of-two head_dim, got {d}")
    return h / d ** 0.5


def _hadamard(part: str) -> None:
    """Codes of H x instead of x (H orthonormal, symmetric); dequantized entries rotated back."""
    import vlm_kv.tiers.int2_tier as tier
    from vlm_kv.tiers.rope_keys import KeyRotation

    def fwd(x: torch.Tensor) -> torch.Tensor:
        return x.float() @ _hadamard_matrix(x.shape[-1]).to(x.device)

    if part in ("keys", "both"):
        unrotate, rotate = KeyRotation.unrotate, KeyRotation.rotate
        KeyRotation.unrotate = lambda self, keys, positions: fwd(unrotate(self, keys, positions))
        KeyRotation.rotate = lambda self, keys, positions: rotate(self, fwd(keys), positions)
    if part in ("values", "both"):
        quantize, dequantize = tier.quantize_values, tier.dequantize_values
        tier.quantize_values = lambda values: quantize(fwd(values))
        tier.dequantize_values = lambda *a: fwd(dequantize(*a))
        tier.Int2Tier.kernel_readable = property(lambda self: False)  # the kernels read the codes unrotated


def main() -> int:
    argv = sys.argv[1:]
    if "--" not in argv:
        print(__doc__)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="scripts/int2_what_if.py")
    p.add_argument("--charge", type=float, default=None)
    p.add_argument("--exact", choices=("keys", "values", "both"), default=None)
    p.add_argument("--key-block", type=int, default=None)
    p.add_argument("--fit", choices=("mse", "mse-keys", "mse-values"), default=None)
    p.add_argument("--hadamard", choices=("keys", "values", "both"), default=None)
    args = p.parse_args(argv[:cut])
    if args.charge is not None:
        _charge(args.charge)
    if args.exact is not None:
        _exact(args.exact)
    if args.key_block is not None:
        _key_block(args.key_block)
    if args.fit is not None:
        _fit(args.fit)
    if args.hadamard is not None:
        _hadamard(args.hadamard)
    from vlm_kv.eval.gate_cells import main as evaluate

    return evaluate(argv[cut + 1:])


if __name__ == "__main__":
    sys.exit(main())
