"""KL per 128-token block of long continuations, one line per cache, from ``vlm-kv fidelity --json`` lines.

    for p in snapkv h2o dbtrimkv; do vlm-kv fidelity ... --continuation 1024 --policy $p --budget 0.1 --json; done > runs.jsonl
    python scripts/plot_kl_blocks.py runs.jsonl --out kl_blocks.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from vlm_kv.eval.fidelity import KL_BLOCK  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jsonl", nargs="+", help="files of fidelity --json lines")
    p.add_argument("--out", required=True, help="PNG to write")
    args = p.parse_args()
    rows = [json.loads(line) for path in args.jsonl for line in open(path, encoding="utf-8") if line.strip()]
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        label = f"{r['policy']}{' + tiers' if r.get('tiers') else ''} @ {r['budget']} ({r.get('dtype', 'float32')})"
        moves = r.get("tier_moves")
        if moves:
            label += f", {moves['promotions']} of {moves['demotions']} demoted windows promoted"
        ends = [min((i + 1) * KL_BLOCK, r["continuation"]) for i in range(len(r["kl_per_block"]))]
        ax.plot(ends, r["kl_per_block"], marker="o", label=label)
    ax.set(xlabel="tokens fed after the prefill (end of each block)", ylabel=f"mean KL over the block ({KL_BLOCK} tokens)",
           yscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
