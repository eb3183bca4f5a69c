"""Pool the multimodal benchmark's rows over data seeds: correct answers summed per (cache, budget).

    python scripts/multimodal_pool.py runs/mm4500/tiered_gates3050:+tiers runs/mm4500/baselines \
        runs/mm4500_s2/tiered_gates3050:+tiers runs/mm4500_s2/baselines --task multi_turn \
        --out docs/smollava/multi_turn_pooled

Each argument is a `vlm-kv sweep --task multimodal` folder, with an optional label suffix as in
``multimodal_table.py`` (``DIR:+tiers``). Folders are grouped by the data seed they swept; within a
seed their full-cache rows must agree (else the script refuses), and a (cache, budget) must come
from each seed exactly once to be pooled: a cell not run on every seed is listed with its seeds, not pooled.
Why pool: one question is 1.1 points of a 16-chat table; two seeds halve what one question moves.
The number of questions per seed comes from the generator (``make_item``), since a row stores
accuracies. Writes ``pooled.json`` and ``pooled.md`` (relative accuracy = correct / the full cache's
correct on the same questions, with the Wilson interval of the pooled accuracy over the full
cache's accuracy).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from multimodal_table import (
    load as load_folders,  # scripts/ is sys.path[0] when run as a script
)
from multimodal_table import questions_per_turn
from retrieval_table import wilson


def _data_seed(spec: str) -> int:
    folder = spec.partition(":")[0]
    return json.loads((Path(folder) / "sweep_multimodal.json").read_text())["settings"]["data_seed"]


def load(specs: list[str], task: str) -> dict[int, dict]:
    """Per data seed: its question count, the full cache's correct answers and each cell's. Each seed's
    folders go through ``multimodal_table.load`` (same items, the same full-cache row, labels applied)."""
    groups: dict[int, list[str]] = {}
    for spec in specs:
        groups.setdefault(_data_seed(spec), []).append(spec)
    seeds: dict[int, dict] = {}
    for data_seed, folders in groups.items():
        (full, *rows), settings, _ = load_folders(folders, task)
        n = sum(questions_per_turn(settings, task))
        cells: dict[tuple, dict] = {}
        for r in rows:
            key = (r["policy"], r["budget"])
            if key in cells:
                raise SystemExit(f"{key} appears twice for data seed {data_seed}")
            cells[key] = {"correct": round(r["accuracy"] * n), "kl": r["kl"]}
        seeds[data_seed] = {"n": n, "full": round(full["accuracy"] * n), "cells": cells, "folders": folders}
    return seeds


def pool(seeds: dict[int, dict]) -> list[dict]:
    keys = sorted({k for s in seeds.values() for k in s["cells"]}, key=lambda k: (k[1], k[0]))
    out = []
    for cache, budget in keys:
        have = [seed for seed, s in sorted(seeds.items()) if (cache, budget) in s["cells"]]
        row = {"cache": cache, "budget": budget, "seeds": have,
               "per_seed": {str(seed): {"correct": seeds[seed]["cells"][(cache, budget)]["correct"],
                                        "full": seeds[seed]["full"], "questions": seeds[seed]["n"],
                                        "kl": seeds[seed]["cells"][(cache, budget)]["kl"]} for seed in have}}
        if len(have) == len(seeds):
            n = sum(s["n"] for s in seeds.values())
            correct = sum(seeds[seed]["cells"][(cache, budget)]["correct"] for seed in have)
            full = sum(s["full"] for s in seeds.values())
            lo, hi = wilson(correct, n)
            row.update(questions=n, correct=correct, full=full, relative=correct / full,
                       relative_lo=lo * n / full, relative_hi=hi * n / full,
                       kl=sum(seeds[s]["cells"][(cache, budget)]["kl"] * seeds[s]["n"] for s in have) / n)
        out.append(row)
    return out


def table(rows: list[dict], seeds: dict[int, dict]) -> str:
    names = sorted(seeds)
    head = ("| cache | budget | " + " | ".join(f"seed {s} (full {seeds[s]['full']} of {seeds[s]['n']})" for s in names)
            + " | pooled relative (95 % interval) | pooled answer KL |")
    lines = [head, "|" + " --- |" * (4 + len(names))]
    for r in rows:
        cells = [f"{r['per_seed'][str(s)]['correct']}" if str(s) in r["per_seed"] else "not run" for s in names]
        pooled = (f"{r['relative']:.3f} ({r['relative_lo']:.2f}-{r['relative_hi']:.2f}), {r['correct']} / {r['full']}"
                  if "relative" in r else "not pooled: seed " + ", ".join(str(s) for s in r["seeds"]) + " only")
        kl = f"{r['kl']:.3f}" if "relative" in r else ""
        lines.append(f"| {r['cache']} | {r['budget']} | " + " | ".join(cells) + f" | {pooled} | {kl} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", help="sweep folders, DIR or DIR:LABEL")
    ap.add_argument("--task", default="multi_turn")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    seeds = load(args.folders, args.task)
    rows = pool(seeds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {str(s): {"questions": v["n"], "full": v["full"], "folders": v["folders"]} for s, v in seeds.items()}
    (out / "pooled.json").write_text(json.dumps({"task": args.task, "seeds": meta, "rows": rows}, indent=1))
    (out / "pooled.md").write_text(table(rows, seeds))
    print(table(rows, seeds))


if __name__ == "__main__":
    main()
