"""The INT2 tier options every command with ``--tiers`` shares (fidelity, bench, sweep, eval, diagnose).

The flags are generated from ``TierConfig``'s fields (a field's metadata names its flag, help and
choices), so a tier setting is declared once, in ``vlm_kv.config``.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from vlm_kv.config import TierConfig


def tier_flag_fields() -> list[dataclasses.Field]:
    """TierConfig's fields that have a command-line flag."""
    return [f for f in dataclasses.fields(TierConfig) if f.metadata.get("flag")]


def add_tier_args(p: argparse.ArgumentParser, window: bool = True) -> None:
    """``--tiers`` and one flag per TierConfig field; ``window=False`` where the command's own
    ``--window`` is also the tiers' (diagnose)."""
    p.add_argument("--tiers", choices=("int2",), default=None,
                   help="route windows to full precision / INT2 / evicted under the same byte budget (QEvict tiers)")
    hints = typing.get_type_hints(TierConfig)
    for f in tier_flag_fields():
        if f.name == "window" and not window:
            continue
        meta = f.metadata
        default = "" if f.default is None else f" (TierConfig's default {f.default}; a policy may set its own)"
        help_text = f"with --tiers: {meta['help']}{default}"
        # None: not given, so the policy's own tier setting stands
        if hints[f.name] is bool:
            p.add_argument(meta["flag"], dest=f.name, action="store_true", default=None, help=help_text)
        elif meta.get("choices"):
            p.add_argument(meta["flag"], dest=f.name, choices=meta["choices"], default=None, help=help_text)
        else:
            kind = int if hints[f.name] is int else float
            p.add_argument(meta["flag"], dest=f.name, type=kind, default=None, help=help_text)


def tier_overrides(args: argparse.Namespace, window: bool = True) -> dict[str, Any]:
    """The TierConfig fields given on the command line (``window=False``: ``args.window`` belongs
    to the command and is not read here)."""
    given = {}
    for f in tier_flag_fields():
        if f.name == "window" and not window:
            continue
        value = getattr(args, f.name, None)
        if value is not None and value is not False:
            given[f.name] = value
    return given


def tier_kwargs(args: argparse.Namespace, window: bool = True) -> dict[str, Any]:
    """``make_cache``'s ``tiers=`` for the options given: ``{}`` (untiered), ``{"tiers": "int2"}``
    (the policy's tier settings) or ``{"tiers": {field: value}}`` (those settings, changed);
    range-checked before any model loads."""
    given = tier_overrides(args, window)
    flags = {f.name: f.metadata["flag"] for f in tier_flag_fields()}
    if given and not getattr(args, "tiers", None):
        raise ValueError(f"{', '.join(flags[k] for k in given)} needs --tiers int2 (INT2 tier options)")
    if not getattr(args, "tiers", None):
        return {}
    TierConfig(**given)  # range checks before any model loads
    return {"tiers": given or args.tiers}

