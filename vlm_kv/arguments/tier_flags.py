"""Command-line options several CLIs share (fidelity, bench, sweep, eval, diagnose): the INT2 tiers."""

from __future__ import annotations

import argparse
from typing import Any

from vlm_kv.config import TierConfig

# option name -> make_cache keyword; store_true options are passed only when set
_FLAGS = {"int2_share": "--int2-share", "int2_value": "--int2-value", "window": "--window", "key_rope": "--key-rope",
          "spill": "--spill", "fp_unit": "--fp-unit", "key_grid": "--key-grid",
          "basis": "--int2-basis"}


def add_tier_args(p: argparse.ArgumentParser, window: bool = True) -> None:
    """The tier options; ``window=False`` where the command's own ``--window`` is also the tiers' (diagnose)."""
    p.add_argument("--tiers", choices=("int2",), default=None,
                   help="route windows to full precision / INT2 / evicted under the same byte budget (QEvict tiers)")
    p.add_argument("--int2-share", type=float, default=None,
                   help="with --tiers: share of the routed bytes spent on INT2 when something must go (default 0.7)")
    p.add_argument("--int2-value", type=float, default=None,
                   help="with --tiers: split FP / INT2 by value per byte instead of --int2-share, an INT2 window "
                        "counting as this fraction of its FP worth (0-1]")
    if window:
        p.add_argument("--window", type=int, default=None, help="with --tiers: tokens per INT2 window (default 8)")
    p.add_argument("--key-rope", choices=("post", "pre"), default=None,
                   help="with --tiers: quantize keys as cached (post-RoPE, default) or rotated back to pre-RoPE")
    p.add_argument("--spill", action="store_true", default=None,
                   help="with --tiers: keep the original FP keys/values of quantized windows in host memory so "
                        "promotion is lossless (host bytes, outside the budget; reported as the 'spill' tier)")
    p.add_argument("--fp-unit", choices=("window", "token"), default=None,
                   help="with --tiers: choose FP by whole windows (QEvict, default) or by single entries "
                        "(INT2 stays per window)")
    p.add_argument("--key-grid", choices=("fp16", "int8"), default=None,
                   help="with --tiers: the keys' per-channel scale/zero of an INT2 window in fp16 (the paper's) or "
                        "as 8-bit codes (int8, the default: a window 22%% cheaper at w 8, head_dim 64)")
    p.add_argument("--int2-basis", dest="basis", choices=("hadamard", "hadamard_keys", "channel"), default=None,
                   help="with --tiers: quantize INT2 windows after a Walsh-Hadamard rotation of keys and values "
                        "(hadamard, the default: same bytes), of the keys only (hadamard_keys) or per channel as "
                        "stored (channel, the paper's)")


def tier_kwargs(args: argparse.Namespace, window: bool = True) -> dict[str, Any]:
    """``make_cache`` keyword arguments for the tier options given (range-checked before any model
    loads); ``window=False``: ``args.window`` belongs to the command and is not read here."""
    kw: dict[str, Any] = {}
    for name in _FLAGS:
        if name == "window" and not window:
            continue
        value = getattr(args, name, None)
        if value is not None and value is not False:
            kw[name] = value
    if kw and not getattr(args, "tiers", None):
        raise ValueError(f"{', '.join(_FLAGS[k] for k in kw)} needs --tiers int2 (INT2 tier options)")
    if getattr(args, "tiers", None):
        TierConfig(**kw)  # range checks before any model loads
        kw["tiers"] = args.tiers
    return kw
