"""Join gate-training runs with their fidelity cells into one ablation table.

    python -m vlm_kv.train.summarize --run A=runs/abl/w64-b5-lr1e-2 --run B=runs/abl/w128-b5-lr1e-2 \\
        --fidelity docs/gates_ablation_pg84.jsonl --out docs/gates_ablation.jsonl --csv docs/gates_ablation.csv

For each run (a ``train-gates --out`` folder) it reads ``metrics.jsonl`` (training time, how often
the capacity term was non-zero, the expected live fraction at the end) and the gate config's
hyperparameters; for each run label it picks the fidelity cells whose label is the run's label
(with sinks) or ``LABEL-nosinks`` (``num_sinks=0``). One output row per run, the budgets as
columns ``kl@0.1`` / ``top1@0.1`` (and ``kl_nosinks@0.1`` ...), printed as a markdown table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os


def training_summary(run_dir: str) -> dict:
    """Steps, seconds and capacity statistics of one training run's ``metrics.jsonl``."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}: not a train-gates output folder")
    with open(path) as fh:
        lines = [json.loads(ln) for ln in fh if ln.strip()]
    if not lines:
        raise ValueError(f"{path} is empty")
    caps = [ln["cap"] for ln in lines]
    last = lines[-10:]
    out = {
        "steps_logged": len(lines),
        "train_seconds": round(sum(ln["sec"] for ln in lines), 1),
        "sec_per_step": round(sum(ln["sec"] for ln in lines) / len(lines), 2),
        "cap_nonzero_steps": sum(c > 0 for c in caps),
        "cap_mean": round(sum(caps) / len(caps), 4),
        "live_end": round(sum(ln["live"] for ln in last) / len(last), 4),       # mean over the last 10 steps
        "kl_train_end": round(sum(ln["kl"] for ln in last) / len(last), 4),
    }
    cfg_path = os.path.join(run_dir, "gate_config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as fh:
            cfg = json.load(fh)
        t = cfg.get("training", {})
        out.update({k: t.get(k) for k in ("steps", "max_length", "lr", "min_lr", "warmup", "budget_range",
                                          "budget_tokens", "init_gates", "seed")})
        out.update(width=cfg["width"], init_bias=cfg["init_bias"], kind=cfg["kind"])
        size = os.path.getsize(os.path.join(run_dir, "gates.safetensors"))
        out["gates_mb"] = round(size / 1e6, 2)
    return out


def fidelity_columns(rows: list[dict], label: str) -> dict:
    """``kl@B`` / ``top1@B`` for cells labelled ``label``, ``kl_nosinks@B`` for ``label-nosinks``."""
    out: dict = {}
    for r in rows:
        no_sinks = (r.get("scorer_kwargs") or {}).get("num_sinks") == 0
        if r["label"] == label and not no_sinks:
            suffix = ""
        elif r["label"] == f"{label}-nosinks" and no_sinks:
            suffix = "_nosinks"
        else:
            continue
        b = f"{r['budget']:g}"
        out[f"kl{suffix}@{b}"] = round(r["kl"], 4)
        out[f"top1{suffix}@{b}"] = round(r["top1"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vlm_kv.train.summarize")
    p.add_argument("--run", action="append", default=[], metavar="LABEL=DIR",
                   help="a training run folder and the label of its fidelity cells")
    p.add_argument("--fidelity", action="append", default=[], help="fidelity JSONL(s) from vlm_kv.eval.gate_cells")
    p.add_argument("--out", required=True, help="JSONL, one line per run")
    p.add_argument("--csv", default=None)
    args = p.parse_args(argv)
    rows: list[dict] = []
    for path in args.fidelity:
        with open(path) as fh:
            rows += [json.loads(ln) for ln in fh if ln.strip()]
    table = []
    for spec in args.run:
        label, sep, run_dir = spec.partition("=")
        if not sep:
            raise SystemExit(f"--run wants LABEL=DIR, got {spec!r}")
        table.append(dict(label=label, run=run_dir, **training_summary(run_dir), **fidelity_columns(rows, label)))
    with open(args.out, "w") as fh:
        for row in table:
            fh.write(json.dumps(row) + "\n")
    cols = list(dict.fromkeys(k for row in table for k in row))
    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=cols)
            w.writeheader()
            for row in table:
                w.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()})
    show = ["label", "width", "init_bias", "lr", "steps", "max_length", "train_seconds", "cap_nonzero_steps",
            "live_end"] + sorted(k for k in cols if "@" in k)
    print("| " + " | ".join(show) + " |")
    print("|" + " --- |" * len(show))
    for row in table:
        print("| " + " | ".join(str(row.get(k, "")) for k in show) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
