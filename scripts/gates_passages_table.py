"""KL / top-1 of several gate sets over several pg84 passages, as a markdown table with the mean.

    python scripts/gates_passages_table.py docs/gates_v2/fidelity_pg84_4passages.jsonl [LABEL ...]

Input: JSON lines of `python -m vlm_kv.eval.gate_cells` (one per label x budget x offset)."""
import json
import sys
from collections import defaultdict


def main(path: str, labels_wanted: list[str]) -> None:
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    if labels_wanted:  # only these labels, in this order
        rows = sorted((r for r in rows if r["label"] in labels_wanted), key=lambda r: labels_wanted.index(r["label"]))
    offsets = sorted({r["offset"] for r in rows})
    cells = defaultdict(dict)
    for r in rows:
        cells[r["label"], r["budget"]][r["offset"]] = r
    labels = list(dict.fromkeys(r["label"] for r in rows))
    print("| gates | budget | " + " | ".join(f"KL @{o}" for o in offsets) + " | mean KL | mean top-1 |")
    print("| --- | --- | " + " | ".join("---" for _ in offsets) + " | --- | --- |")
    for budget in sorted({r["budget"] for r in rows}):
        for label in labels:
            got = cells.get((label, budget), {})
            if len(got) != len(offsets):
                continue  # a set not run on every passage has no comparable mean
            kls = [got[o]["kl"] for o in offsets]
            top1 = sum(got[o]["top1"] for o in offsets) / len(offsets)
            print(f"| {label} | {budget} | " + " | ".join(f"{k:.4f}" for k in kls)
                  + f" | {sum(kls) / len(kls):.4f} | {top1:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
