"""The ablation table of the retrieval-aware gate fine-tunes (docs/retrieval.md, issue 26).

    python scripts/gates_facts_table.py            # prints the markdown table

Validation retrieval from ``docs/retrieval/val/<set>/{fp32,bf16_tiered}/sweep_retrieval.json``
(correct of 24, question asked later) and the mean KL over the pg84 passages of
``docs/retrieval/kl_check_pg84.jsonl`` (tiered bf16, 2048 + 128 tokens), with its change against v3.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

ROOT = Path("docs/retrieval")
SETS = {  # label in the KL file -> (validation folder, what the run changed)
    "v3": ("v3", "shipped until 2026-12-03: 200 steps from scratch, no facts"),
    "plain": ("plain", "v3 + 60 steps, no facts"),
    "facts-aw0": ("facts-aw0", "v3 + 60 steps, half facts chats, plain average"),
    "facts-aw1": ("facts-aw1", "v3 + 60 steps, half facts chats, answer weight 1 (**v4**, shipped)"),
    "facts-aw3": ("facts-aw3", "v3 + 60 steps, half facts chats, answer weight 3"),
}
BUDGETS = (0.05, 0.1, 0.25)


def retrieval(folder: Path) -> dict[float, str]:
    path = folder / "sweep_retrieval.json"
    if not path.exists():
        return {}
    rows = json.loads(path.read_text())["rows"]
    return {r["budget"]: f"{sum(x['correct'] for x in r['records'])}" for r in rows if not r.get("error")}


def kl_means() -> dict[str, dict[float, tuple[float, int]]]:
    cells: dict = defaultdict(lambda: defaultdict(list))
    for line in (ROOT / "kl_check_pg84.jsonl").read_text().splitlines():
        r = json.loads(line)
        cells[r["label"]][r["budget"]].append(r["kl"])
    return {label: {b: (sum(v) / len(v), len(v)) for b, v in per.items()} for label, per in cells.items()}


def main() -> None:
    kl = kl_means()
    base = kl.get("v3", {})
    lines = ["| gates | run | val. later fp32 0.05 / 0.1 / 0.25 | val. later tiered bf16 0.05 / 0.1 "
             "| KL 0.05 | KL 0.1 | KL 0.25 | passages |", "|---|---|---|---|---|---|---|---|"]
    for label, (folder, what) in SETS.items():
        fp = retrieval(ROOT / "val" / folder / "fp32")
        tq = retrieval(ROOT / "val" / folder / "bf16_tiered")
        fp_s = " / ".join(fp.get(b, "-") for b in BUDGETS)
        tq_s = " / ".join(tq.get(b, "-") for b in BUDGETS[:2])
        kls = []
        for b in BUDGETS:
            if b not in kl.get(label, {}):
                kls.append("-")
                continue
            m, _ = kl[label][b]
            change = f" ({100 * (m / base[b][0] - 1):+.0f} %)" if label != "v3" and b in base else ""
            kls.append(f"{m:.4f}{change}")
        n = min((c for _, c in kl.get(label, {}).values()), default=0)
        lines.append(f"| {label} | {what} | {fp_s} | {tq_s} | {' | '.join(kls)} | {n} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
