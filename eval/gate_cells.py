"""Fidelity grid for gate sets: one shared full-cache reference, many (gates, policy, budget) cells.

    python -m vlm_kv.eval.gate_cells --text ../shared/data/text/pg84.txt --offset 100000 \\
        --context 2048 --continuation 128 --out docs/gates_fidelity_pg84.jsonl \\
        --cell new:dbtrimkv:0.1:gates=runs/main --cell shipped:dbtrimkv:0.1 --cell base:rkv:0.1 \\
        --cell new-nosinks:dbtrimkv:0.1:gates=runs/main,num_sinks=0 \\
        --cell new-thr:dbtrimkv_threshold:1.0:gates=runs/main,log_alpha=-6

A cell is ``LABEL:POLICY:BUDGET[:key=value,...]``; keys: ``gates`` (folder), ``num_sinks`` and
``recent_ratio`` (scorer), ``log_alpha`` (threshold allocation), ``min_per_head`` (global
allocation), ``evict_every`` (decode steps between eviction steps), ``attention_backend``
(``torch``: the pure PyTorch decode path instead of a compiled kernel), ``tiers`` and every ``TierConfig`` field with a command-line flag (``int2_share``,
``window``, ``key_rope``, ``spill``, ``int2_value``, ``fp_unit``, ``key_grid``, ``basis``: recoverable INT2
tiers, merged over the policy's own tier settings as ``make_cache(tiers={...})`` does). ``--dtype bfloat16`` runs the model and every cache in bf16 (budgets
are fractions of the full cache in that dtype). Each finished cell is appended to ``--out``
as one JSON line (with kl, top1, nll, full_nll, bytes) and skipped when the file already
has it, so an interrupted grid resumes; ``--csv`` writes the table of every line.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import time
import typing

import torch

from vlm_kv.api import tiers_with_fields
from vlm_kv.arguments.tier_flags import tier_flag_fields
from vlm_kv.config import CacheOptions, TierConfig
from vlm_kv.eval.fidelity import measure, run_reference, text_tokens
from vlm_kv.models.named import load_model

# a cell's tier options: ``tiers`` and every TierConfig field with a flag, typed as the field is
_TIER_HINTS = typing.get_type_hints(TierConfig)


def _truth(value: str) -> bool:
    if value.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return value.lower() in ("true", "1")


def _cell_type(kind):
    """How a cell option's text becomes the TierConfig field's type."""
    return {int: int, bool: _truth, float: float, float | None: float}.get(kind, str)


_CACHE_OPTIONS = {"tiers": str, "evict_every": int, "attention_backend": str,
                  **{f.name: _cell_type(_TIER_HINTS[f.name]) for f in tier_flag_fields()}}


def cell_cache_kwargs(cell: dict) -> dict:
    """``make_cache`` keywords of a cell: ``gates=``, ``options=`` (scorer / allocation fields) and
    ``tiers=`` ("int2" or a dict of the TierConfig fields the cell sets)."""
    flat = dict(cell.get("cache_kwargs") or {})
    kwargs: dict = {"options": CacheOptions(scorer_kwargs=cell["scorer_kwargs"] or None,
                                            allocation_kwargs=cell["allocation_kwargs"] or None,
                                            evict_every=flat.pop("evict_every", None),
                                            attention_backend=flat.pop("attention_backend", "auto"))}
    if cell["gates"]:
        kwargs["gates"] = cell["gates"]
    tiers = tiers_with_fields(cell["policy"], flat.pop("tiers", None), flat)
    if tiers is not None:
        kwargs["tiers"] = tiers
    return kwargs


def parse_cell(text: str) -> dict:
    parts = text.split(":", 3)
    if len(parts) < 3:
        raise argparse.ArgumentTypeError(f"cell must be LABEL:POLICY:BUDGET[:k=v,...], got {text!r}")
    cell = {"label": parts[0], "policy": parts[1], "budget": float(parts[2]), "gates": None,
            "scorer_kwargs": {}, "allocation_kwargs": {}}
    for item in (parts[3].split(",") if len(parts) == 4 and parts[3] else []):
        key, _, value = item.partition("=")
        if key == "gates":
            cell["gates"] = value
        elif key == "num_sinks":
            cell["scorer_kwargs"]["num_sinks"] = int(value)
        elif key == "recent_ratio":
            cell["scorer_kwargs"]["recent_ratio"] = float(value)
        elif key in _CACHE_OPTIONS:
            cell.setdefault("cache_kwargs", {})[key] = _CACHE_OPTIONS[key](value)
        elif key == "log_alpha":
            cell["allocation_kwargs"]["log_alpha"] = float(value)
        elif key == "min_per_head":
            cell["allocation_kwargs"]["min_per_head"] = int(value)
        else:
            raise argparse.ArgumentTypeError(f"unknown cell option {key!r} in {text!r}")
    return cell


def cell_key(cell: dict) -> str:
    """Identity of a cell: everything that changes its result."""
    opts = [cell.get("gates"), cell.get("scorer_kwargs") or {}, cell.get("allocation_kwargs") or {}]
    # only when set, so that the keys of files written before these options existed stay the same
    if cell.get("cache_kwargs"):
        opts.append(cell["cache_kwargs"])
    if cell.get("dtype", "float32") != "float32":
        opts.append(cell["dtype"])
    # the run the cell is measured on: one --out can then hold several passages
    run = [cell[k] for k in ("text", "offset", "context", "continuation") if k in cell]
    return f"{cell['label']}|{cell['policy']}|{cell['budget']}|{json.dumps(opts, sort_keys=True)}|{run}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vlm_kv.eval.gate_cells")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--text", required=True)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--continuation", type=int, default=128)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--cell", action="append", type=parse_cell, required=True)
    p.add_argument("--out", required=True, help="JSONL of finished cells (appended; resumes)")
    p.add_argument("--csv", default=None, help="also write every line of --out as CSV")
    p.add_argument("--plot", default=None, help="also plot KL against the KV bytes held (PNG)")
    args = p.parse_args(argv)

    for cell in args.cell:
        cell.update(dtype=args.dtype, text=os.path.basename(args.text), offset=args.offset, context=args.context,
                    continuation=args.continuation)
    done = set()
    if os.path.exists(args.out):
        with open(args.out) as fh:
            done = {cell_key(json.loads(line)) for line in fh if line.strip()}
    todo = [c for c in args.cell if cell_key(c) not in done]
    if todo:
        model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
        ids = text_tokens(tokenizer, args.text, args.offset, args.context + args.continuation + 1)
        with torch.no_grad():
            reference = run_reference(model, ids, args.context)
        for cell in todo:
            t0 = time.perf_counter()
            kwargs = cell_cache_kwargs(cell)
            with torch.no_grad():
                r = measure(model, ids, args.context, cell["policy"], cell["budget"], reference, **kwargs)
            row = dict(cell, **r.as_dict(), seconds=round(time.perf_counter() - t0, 1),
                       kv_fraction=r.kv_bytes / r.full_kv_bytes, max_kv_fraction=r.max_kv_bytes / r.full_kv_bytes,
                       text=os.path.basename(args.text), offset=args.offset)
            with open(args.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(f"{cell['label']:>16} {cell['policy']:>18} {cell['budget']:<5} kl {r.kl:.4f} top1 {r.top1:.3f} "
                  f"nll {r.nll:.4f} (full {r.full_nll:.4f}) kv {row['kv_fraction']:.3f}", flush=True)
    if args.csv:
        with open(args.out) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        cols = ["label", "policy", "budget", "kl", "top1", "nll", "full_nll", "kv_fraction", "max_kv_fraction",
                "kv_bytes", "max_kv_bytes", "full_kv_bytes", "gates", "scorer_kwargs", "allocation_kwargs",
                "cache_kwargs", "dtype",
                "context", "continuation", "text", "offset", "seconds"]
        with open(args.csv, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
            w.writeheader()
            for row in rows:
                w.writerow({k: json.dumps(v) if isinstance(v, dict) else v for k, v in row.items()})
    if args.plot:
        with open(args.out) as fh:
            plot(args.plot, [json.loads(line) for line in fh if line.strip()])
    return 0


def plot(path: str, rows: list[dict]) -> None:
    """KL (log scale) against the fraction of the full cache's bytes held, one line per series."""
    # lazy: matplotlib is optional (the eval extra)
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib is optional (the eval extra)
    import matplotlib.pyplot as plt

    series: dict[str, list] = {}
    for r in rows:
        name = f"{r['label']} {r['policy']}"
        if r.get("scorer_kwargs", {}).get("num_sinks") == 0:
            name += " (no sinks)"
        series.setdefault(name, []).append((r["kv_fraction"], r["kl"]))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, pts in sorted(series.items()):
        pts.sort()
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("KV bytes held / full cache")
    ax.set_ylabel("KL(full || compressed), nats/token")
    ax.set_title("SmolLM2-135M, pg84 @100000, 2048 + 128 tokens")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
