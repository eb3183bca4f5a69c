"""Command-line options several CLIs share (fidelity, bench, sweep, eval): the INT2 tiers."""

from __future__ import annotations

import argparse
from typing import Any


def add_tier_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiers", choices=("int2",), default=None,
                   help="route windows to full precision / INT2 / evicted under the same byte budget (QEvict tiers)")
    p.add_argument("--int2-share", type=float, default=None,
                   help="with --tiers: share of the routed bytes spent on INT2 when something must go (default 0.7)")
    p.add_argument("--int2-value", type=float, default=None,
                   help="with --tiers: split FP / INT2 by value per byte instead of --int2-share, an INT2 window "
                        "counting as this fraction of its FP worth (0-1]")
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
                        "as 8-bit codes (int8: a window 22%% cheaper at w 8, head_dim 64)")


def tier_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``make_cache`` keyword arguments for the tier options given (checked by ``make_cache``)."""
    kw: dict[str, Any] = {}
    if getattr(args, "tiers", None):
        kw["tiers"] = args.tiers
    if getattr(args, "int2_share", None) is not None:
        kw["int2_share"] = args.int2_share
    if getattr(args, "int2_value", None) is not None:
        kw["int2_value"] = args.int2_value
    if getattr(args, "window", None) is not None:
        kw["window"] = args.window
    if getattr(args, "key_rope", None) is not None:
        kw["key_rope"] = args.key_rope
    if getattr(args, "spill", None):
        kw["spill"] = True
    if getattr(args, "fp_unit", None) is not None:
        kw["fp_unit"] = args.fp_unit
    if getattr(args, "key_grid", None) is not None:
        kw["key_grid"] = args.key_grid
    if kw and "tiers" not in kw:
        raise ValueError("--int2-share, --int2-value, --window, --key-rope, --spill, --fp-unit and --key-grid configure "
                         "the INT2 tier: "
                         "add --tiers int2")
    if kw:
        from vlm_kv.tier_router import TierConfig

        TierConfig(**{k: v for k, v in kw.items() if k != "tiers"})  # range checks before any model loads
    return kw
