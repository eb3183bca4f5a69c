"""The retrieval tables of docs/retrieval/: relative accuracy per cache, budget and question placement.

    python scripts/retrieval_table.py docs/retrieval      # writes table.md, table.csv and relative_accuracy.png there
    python scripts/retrieval_table.py docs/retrieval/val  # the validation sweeps that chose the gates
    python scripts/retrieval_table.py docs/retrieval/ctx2048  # the 2048-token haystacks
    python scripts/retrieval_table.py OUT --from DIR DIR ...  # trials of the same cells pooled (other seeds)

Reads every ``*/sweep_retrieval.json`` and ``*/*/sweep_retrieval.json`` below the folder (one sweep
per dtype / tiering / --ask / gate set), except the ``val`` and ``ctx2048`` folders' (the validation
passage, the 2048-token haystacks: each has its own table).
Gated policies are labelled with their gate set: ``v3`` for the default gates (every sweep here
that ran without ``--gates`` predates session 16, when v3 was the default) and for
``docs/retrieval/v3_gates.sh``'s copy, else the folder name of ``--gates`` (``facts-aw05``: the
retrieval-aware fine-tune shipped as the v4 default; ``facts-aw1``: its sibling, not shipped). New
sweeps of the default gates must name them with ``--gates`` to be labelled right.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

SHIPPED = "smollm2-135m-dbtrimkv"


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def variant_label(policy: str, settings: dict, gate_set: str) -> str:
    """What sets a run apart from the policy's default, in its label: the gate set of a gated policy
    (or of a strategy's gated patterns), the strategy file, the scorer's fields. A variant must not
    pool into the default's cell (session 30's span-5 run would have, under the old labels)."""
    kwargs = settings.get("cache_kwargs") or {}
    label = ""
    if "trimkv" in policy or (policy == "polykv" and kwargs.get("gates")):
        label += f" [{gate_set}]"
    if kwargs.get("strategy"):
        label += f" <{Path(kwargs['strategy']).stem}>"
    fields = (kwargs.get("options") or {}).get("scorer_kwargs") or {}
    if fields:
        label += " {" + ", ".join(f"{k}={v}" for k, v in sorted(fields.items())) + "}"
    return label


def rows(folder: Path) -> list[dict]:
    out = []
    paths = sorted(folder.glob("*/sweep_retrieval.json")) + sorted(folder.glob("*/*/sweep_retrieval.json"))
    for path in paths:
        if path.relative_to(folder).parts[0] in ("val", "ctx2048"):  # their own tables
            continue
        state = json.loads(path.read_text())
        settings = state["settings"]
        dtype = "bfloat16" if "bfloat16" in str(settings.get("model")) else "float32"
        tiers = (settings.get("cache_kwargs") or {}).get("tiers")
        ask = settings.get("ask", "prompt")
        gates = (settings.get("cache_kwargs") or {}).get("gates")
        gate_set = "v3" if not gates or "gates_v3" in gates or Path(gates).name == SHIPPED else Path(gates).name
        for r in state["rows"]:
            if r.get("error") or r.get("accuracy") is None:
                continue
            n = len(r["records"])
            hits = sum(1 for x in r["records"] if x["correct"])
            full = r["full_accuracy"] or float("nan")
            lo, hi = wilson(hits, n)
            cache = f"{r['policy']}{variant_label(r['policy'], settings, gate_set)}{' + tiers' if tiers else ''} " \
                    f"({'bf16' if dtype == 'bfloat16' else 'fp32'})"
            out.append({"cache": cache, "ask": ask, "budget": r["budget"], "n": n, "hits": hits,
                        "full_hits": sum(1 for x in r["records"] if x["full_correct"]), "accuracy": r["accuracy"],
                        "full_accuracy": r["full_accuracy"], "relative": r["accuracy"] / full,
                        "relative_lo": lo / full, "relative_hi": hi / full, "kv_fraction": r["max_kv_bytes_after_eviction"] / r["full_kv_bytes_at_end"],
                        "run": str(path.parent.relative_to(folder))})
    return out


def pooled(folders: list[Path]) -> list[dict]:
    """One row per (cache, question, budget) over every folder: trials and hits summed (Wilson interval
    of the pooled trials, relative to the full cache's hits on the same trials)."""
    cells: dict[tuple, dict] = {}
    seen: set[tuple] = set()
    for folder in folders:
        for r in rows(folder):
            run = (str((folder / r["run"]).resolve()), r["cache"], r["budget"])
            if run in seen:  # a sweep below two of the folders (a seed folder inside the first) counts once
                continue
            seen.add(run)
            key = (r["cache"], r["ask"], r["budget"])
            cell = cells.setdefault(key, {"cache": r["cache"], "ask": r["ask"], "budget": r["budget"], "n": 0,
                                          "hits": 0, "full_hits": 0, "runs": []})
            cell["n"] += r["n"]
            cell["hits"] += r["hits"]
            cell["full_hits"] += r["full_hits"]
            cell["runs"].append(f"{folder}/{r['run']}")
    out = []
    for c in cells.values():
        full = c["full_hits"] / c["n"]
        lo, hi = wilson(c["hits"], c["n"])
        out.append({**{k: c[k] for k in ("cache", "ask", "budget", "n", "hits", "full_hits")},
                    "accuracy": c["hits"] / c["n"], "full_accuracy": full, "relative": c["hits"] / c["full_hits"],
                    "relative_lo": lo / full, "relative_hi": hi / full, "runs": " ".join(c["runs"])})
    return out


def main() -> None:
    args = sys.argv[1:]
    folder = Path(args[0] if args else "docs/retrieval")
    if "--from" in args:
        table = pooled([Path(f) for f in args[args.index("--from") + 1 :]])
        folder.mkdir(parents=True, exist_ok=True)
    else:
        table = rows(folder)
    with open(folder / "table.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    lines = ["| cache | question | budget | relative accuracy (95 % interval) | correct / trials | full cache |",
             "|---|---|---|---|---|---|"]
    for r in sorted(table, key=lambda r: (r["ask"], r["cache"], r["budget"])):
        lines.append(f"| {r['cache']} | {r['ask']} | {r['budget']} | {r['relative']:.2f} ({r['relative_lo']:.2f}-"
                     f"{r['relative_hi']:.2f}) | {round(r['accuracy'] * r['n'])} / {r['n']} | {r['full_accuracy']:.2f} |")
    (folder / "table.md").write_text("\n".join(lines) + "\n")
    asks = sorted({r["ask"] for r in table})
    fig, axes = plt.subplots(1, len(asks), figsize=(5.5 * len(asks), 4), squeeze=False, sharey=True)
    for ax, ask in zip(axes[0], asks):
        for cache in sorted({r["cache"] for r in table if r["ask"] == ask}):
            pts = sorted((r["budget"], r["relative"], r["relative_lo"], r["relative_hi"]) for r in table
                         if r["ask"] == ask and r["cache"] == cache)
            xs = [p[0] for p in pts]
            ax.errorbar(xs, [p[1] for p in pts], yerr=[[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]],
                        marker="o", capsize=3, label=cache)
        ax.set(title=f"question asked {'in the prompt' if ask == 'prompt' else 'later, in a new turn'}",
               xlabel="budget (fraction of the full cache)", xscale="log", ylim=(-0.05, 1.1))
        ax.set_xticks([0.05, 0.1, 0.25], ["0.05", "0.1", "0.25"])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")  # each panel has its own caches
    axes[0][0].set_ylabel("accuracy relative to the full cache")
    fig.tight_layout()
    fig.savefig(folder / "relative_accuracy.png", dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
