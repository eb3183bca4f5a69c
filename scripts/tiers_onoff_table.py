"""One Markdown table, policy x budget, tiers off / on, from four ``vlm-kv sweep --task fidelity`` folders.

    python scripts/tiers_onoff_table.py docs/tiers/s8_bf16_untiered docs/tiers/s8_bf16_tiered \\
        docs/tiers/s8_fp32_untiered docs/tiers/s8_fp32_tiered

Folders are given as (untiered, tiered) pairs; each pair is one dtype (its label from the folder
name). A cell is the KL (top-1 agreement); empty where that run has no such policy / budget.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(folder: str) -> dict:
    state = json.loads((Path(folder) / "sweep_fidelity.json").read_text())
    return {(r["policy"], float(r["budget"])): r for r in state["rows"] if not r.get("error")}


def _label(folder: str) -> str:
    """``docs/tiers/s8_bf16_untiered`` -> ``bf16``."""
    name = Path(folder).name
    for cut in ("s8_", "s9_", "_untiered", "_tiered"):
        name = name.replace(cut, "")
    return name


def main(folders: list[str]) -> None:
    if len(folders) % 2:
        raise SystemExit("give (untiered, tiered) folder pairs")
    pairs = [(_label(folders[i]), load(folders[i]), load(folders[i + 1])) for i in range(0, len(folders), 2)]
    keys = sorted({k for _, a, b in pairs for k in (*a, *b)}, key=lambda k: (k[1], k[0] != "dbtrimkv", k[0]))
    head = " | ".join(f"{name} off | {name} on" for name, _, _ in pairs)
    print(f"| budget | policy | {head} |")
    print("| --- | --- | " + " | ".join("---" for _ in range(2 * len(pairs))) + " |")
    for policy, budget in keys:
        cells = []
        for _, off, on in pairs:
            for table in (off, on):
                r = table.get((policy, budget))
                cells.append(f"{r['kl']:.4f} ({r['top1']:.3f})" if r else "")
        print(f"| {budget} | {policy} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
