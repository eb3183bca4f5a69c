"""Collect the tier sweeps (docs/tiers/<run>/sweep_fidelity.json) into one CSV and a Markdown table.

    python scripts/tiers_table.py docs/tiers > docs/tiers/table.md

Each run folder is one ``vlm-kv sweep --task fidelity`` output; its settings say the dtype (model
name) and the cache options (tiers, int2_share, key_rope, spill). Writes ``<folder>/fidelity_pg84.csv`` and ``<folder>/kl_vs_bytes_bf16.png``.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

COLUMNS = ["dtype", "tiers", "int2_share", "window", "key_rope", "spill", "policy", "budget", "kl", "top1", "nll", "full_nll",
           "held_fraction", "max_kv_bytes", "full_kv_bytes", "decode_ms_per_token", "run"]


def rows(folder: Path) -> list[dict]:
    out = []
    for path in sorted(folder.glob("*/sweep_fidelity.json")):
        state = json.loads(path.read_text())
        settings = state["settings"]
        dtype = "bfloat16" if "bfloat16" in settings["model"] else "float32"
        kw = dict(settings.get("cache_kwargs") or {})
        if isinstance(kw.get("tiers"), dict):  # tiers={fields} (current) or flat fields beside tiers="int2" (older runs)
            kw = {**kw, **kw["tiers"], "tiers": "int2"}
        for r in state["rows"]:
            if r.get("error"):
                continue
            tiered = kw.get("tiers") or ("int2" if r["policy"] in ("qevict", "kivi2") else "")
            out.append({
                "dtype": dtype, "tiers": tiered or "none",
                "int2_share": kw.get("int2_share", 0.7 if tiered and r["policy"] != "kivi2" else ""),
                "window": kw.get("window", 32 if r["policy"] == "kivi2" else 8) if tiered else "",
                "key_rope": kw.get("key_rope", "post") if tiered else "",
                "spill": "yes" if kw.get("spill") else "",
                "policy": r["policy"], "budget": r["budget"], "kl": r["kl"], "top1": r["top1"], "nll": r["nll"],
                "full_nll": r["full_nll"], "held_fraction": r["max_kv_bytes"] / r["full_kv_bytes"],
                "max_kv_bytes": r["max_kv_bytes"], "full_kv_bytes": r["full_kv_bytes"],
                "decode_ms_per_token": r["decode_ms_per_token"], "run": path.parent.name,
            })
    return sorted(out, key=lambda r: (r["dtype"], float(r["budget"]), r["kl"]))


def plot(table: list[dict], path: Path) -> None:
    """KL against bytes held, bf16, one line per (policy, tiers) at the default q and post-RoPE keys."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines: dict[str, list] = {}
    for r in table:
        if r["dtype"] != "bfloat16" or r["key_rope"] == "pre" or r["int2_share"] not in ("", 0.7) \
                or r["window"] not in ("", 8, 32 if r["policy"] == "kivi2" else 8):
            continue
        label = f"{r['policy']} + INT2 tiers" if r["tiers"] == "int2" and r["policy"] not in ("qevict", "kivi2") \
            else r["policy"]
        if r["spill"]:
            label += " + spill"
        lines.setdefault(label, []).append((r["held_fraction"], r["kl"]))
    for label, pts in sorted(lines.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label,
                linestyle="-" if "tiers" in label or label == "qevict" else "--")
    ax.set(xlabel="KV bytes held / full cache (bf16)", ylabel="KL(full || compressed)", yscale="log",
           title="SmolLM2-135M, pg84, 2048 + 128 tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(folder: str) -> None:
    root = Path(folder)
    table = rows(root)
    plot(table, root / "kl_vs_bytes_bf16.png")
    with open(root / "fidelity_pg84.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table)
    print("| dtype | budget | policy | tiers | q | w | keys | spill | KV held (max) | KL | top-1 | NLL (full) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        print(f"| {r['dtype']} | {r['budget']} | {r['policy']} | {r['tiers']} | {r['int2_share']} | {r['window']} | {r['key_rope']} | {r['spill']} | "
              f"{r['held_fraction']:.3f} | {r['kl']:.4f} | {r['top1']:.3f} | {r['nll']:.4f} ({r['full_nll']:.4f}) |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/tiers")
