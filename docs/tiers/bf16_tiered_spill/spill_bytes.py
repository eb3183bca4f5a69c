"""Host bytes of the spill tier over the same fidelity runs as the sweep in this folder.

The sweep's rows record the device bytes (``kv_bytes()["total"]``) and KL; the spill tier's host
copies are outside that total, so this runs the same cells (same tokens, same full-cache
reference, same ``vlm_kv.eval.fidelity.measure``) keeping a handle on the cache, and writes per cell
the spill bytes after every routing event (max and at the end), the promotions and how many of
them were served losslessly, next to KL (which must equal the sweep's).

    cd /tmp && OMP_NUM_THREADS=1 python /work/wt-spill/docs/tiers/bf16_tiered_spill/spill_bytes.py \\
        --cells dbtrimkv:0.05,dbtrimkv:0.1,qevict:0.05,qevict:0.1 --out spill_bytes.jsonl [--without-spill]

``--without-spill`` runs the same cells with the spill tier off (promotions dequantize), for the
promotion counts of the baseline.
"""

from __future__ import annotations

import argparse
import json

import torch

import vlm_kv
from vlm_kv.eval.fidelity import measure, run_reference, text_tokens
from vlm_kv.models.smollm2 import load_model

TEXT = "/work/shared/data/text/pg84.txt"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", required=True, help="policy:budget,... (tiers int2)")
    p.add_argument("--text", default=TEXT)
    p.add_argument("--offset", type=int, default=100000)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--continuation", type=int, default=128)
    p.add_argument("--out", required=True)
    p.add_argument("--without-spill", action="store_true")
    args = p.parse_args()
    cells = [(c.split(":")[0], float(c.split(":")[1])) for c in args.cells.split(",")]
    model, tok = load_model("smollm2", dtype=torch.bfloat16)
    ids = text_tokens(tok, args.text, args.offset, args.context + args.continuation + 1)
    reference = run_reference(model, ids, args.context)
    for policy, budget in cells:
        spill_after_event: list[int] = []
        holder = {}

        def factory():
            cache = vlm_kv.make_cache(model, policy=policy, budget=budget, tiers={"spill": not args.without_spill})
            evict = cache.evict

            def watched() -> None:
                evict()
                spill_after_event.append(cache.kv_bytes()["per_tier"]["spill"])

            cache.evict = watched
            holder["cache"] = cache
            return cache

        r = measure(model, ids, args.context, policy, budget, reference, cache_factory=factory)
        cache = holder["cache"]
        row = {
            "policy": policy, "budget": budget, "spill": not args.without_spill, "kl": r.kl, "top1": r.top1,
            "max_kv_bytes": r.max_kv_bytes, "full_kv_bytes": r.full_kv_bytes,
            "spill_bytes_end": cache.kv_bytes()["per_tier"]["spill"],
            "spill_bytes_max": max(spill_after_event),
            "per_tier_end": cache.kv_bytes()["per_tier"],
            "tier_stats_end": cache.stats()["per_tier"],
            "routing_events": len(spill_after_event),
        }
        with open(args.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
