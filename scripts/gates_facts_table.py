"""The ablation table of the retrieval-aware gate fine-tunes (docs/retrieval.md, issue 26).

    python scripts/gates_facts_table.py            # prints the markdown table

Validation retrieval from ``docs/retrieval/val/<set>/{fp32,bf16_tiered}/sweep_retrieval.json``
(correct of 24, question asked later) and the mean KL over the pg84 passages of
``docs/retrieval/kl_check_pg84.jsonl`` (tiered bf16, 2048 + 128 tokens) that v3 was measured on
too, with its change against v3 on the same passages.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

ROOT = Path("docs/retrieval")
SETS = {  # label in the KL file -> (validation folder, what the run changed)
    "v3": ("v3", "shipped: 200 steps from scratch, no facts"),
    "plain": ("plain", "v3 + 60 steps, no facts"),
    "facts-aw0": ("facts-aw0", "v3 + 60 steps, half facts chats, plain average"),
    "facts-aw1": ("facts-aw1", "v3 + 60 steps, half facts chats, answer weight 1 (not shipped: KL)"),
    "facts-aw3": ("facts-aw3", "v3 + 60 steps, half facts chats, answer weight 3"),
    "facts-aw05": ("facts-aw05", "v3 + 60 steps, half facts chats, answer weight 0.5"),
    "facts-s25-aw1": ("facts-s25-aw1", "v3 + 60 steps, a quarter facts chats, answer weight 1"),
}
BUDGETS = (0.05, 0.1, 0.25)


def retrieval(folder: Path) -> dict[float, str]:
    path = folder / "sweep_retrieval.json"
    if not path.exists():
        return {}
    rows = json.loads(path.read_text())["rows"]
    return {r["budget"]: f"{sum(x['correct'] for x in r['records'])}" for r in rows if not r.get("error")}


def kl_cells() -> dict[str, dict[float, dict[int, float]]]:
    """label -> budget -> passage offset -> KL."""
    cells: dict = defaultdict(lambda: defaultdict(dict))
    for line in (ROOT / "kl_check_pg84.jsonl").read_text().splitlines():
        r = json.loads(line)
        cells[r["label"]][r["budget"]][r["offset"]] = r["kl"]
    return cells


def paired_means(cells: dict, label: str, budget: float) -> tuple[float, float, int] | None:
    """(mean KL of ``label``, mean KL of v3, passages) over the passages both were measured on."""
    mine, base = cells.get(label, {}).get(budget, {}), cells.get("v3", {}).get(budget, {})
    common = sorted(set(mine) & set(base))
    if not common:
        return None
    return (sum(mine[o] for o in common) / len(common), sum(base[o] for o in common) / len(common), len(common))


def main() -> None:
    cells = kl_cells()
    header = ("| gates | run | val. later fp32 0.05 / 0.1 / 0.25 | val. later tiered bf16 0.05 / 0.1 "
              "| KL 0.05 | KL 0.1 | KL 0.25 | passages |")
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    for label, (folder, what) in SETS.items():
        fp = retrieval(ROOT / "val" / folder / "fp32")
        tq = retrieval(ROOT / "val" / folder / "bf16_tiered")
        fp_s = " / ".join(fp.get(b, "-") for b in BUDGETS)
        tq_s = " / ".join(tq.get(b, "-") for b in BUDGETS[:2])
        kls, counts = [], []
        for b in BUDGETS:
            paired = paired_means(cells, label, b)
            if paired is None:
                kls.append("-")
                continue
            m, m3, n_b = paired
            counts.append(n_b)
            kls.append(f"{m:.4f}" + (f" ({100 * (m / m3 - 1):+.0f} %)" if label != "v3" else ""))
        n = min(counts, default=0)
        lines.append(f"| {label} | {what} | {fp_s} | {tq_s} | {' | '.join(kls)} | {n} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
