"""How fast tiered decode could be if routing cost nothing: the ceiling a bench row allows.

    python scripts/decode_ceiling.py docs/tiered_decode/interval_sweep_s26_2threads.jsonl ...

For each tiered row of a paired bench file (``vlm-kv bench --json`` rows: the full cache's row, then
the tiered row of the same run), prints the measured ratio to the full cache, the time a token
spends outside routing events (decode ms x (1 - evict_share)), the ratio with routing at zero
cost, and the routing time a token could still spend at a target ratio (``--target``, 1.5).
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--target", type=float, default=1.5)
    args = ap.parse_args()
    print("| file | routing interval | full ms/token | tiered ms/token | ratio | routing ms/token | "
          f"ratio with free routing | routing ms/token allowed at {args.target}x |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.files:
        full = None
        with open(name, encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh]
        for row in rows:
            if row["policy"] == "full":
                full = row
                continue
            if full is None or full["context"] != row["context"]:
                raise SystemExit(f"{name}: a tiered row without the full cache's row of its run before it")
            tiered, base = row["decode_ms_per_token"], full["decode_ms_per_token"]
            routing = tiered * row["evict_share"]
            rest = tiered - routing
            allowed = base / args.target - rest
            print(f"| {name.split('/')[-1]} | {row.get('evict_every')} | {base:.1f} | {tiered:.1f} | {base / tiered:.2f}x "
                  f"| {routing:.1f} | {base / rest:.2f}x | {allowed:.1f} |")


if __name__ == "__main__":
    main()
