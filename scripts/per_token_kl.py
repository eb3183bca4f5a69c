"""Per-token KL of tiered caches in several INT2 bases against one full-cache run (docs/tiers.md, session 9).

The fidelity KL is a mean over the continuation's tokens; at small budgets a token or two can carry
much of it. This prints, for each basis, the mean, the median, the five largest per-token KLs and the
mean without the three largest, and how many tokens each basis loses against the first one.

    python scripts/per_token_kl.py --text ../shared/data/text/pg84.txt --offset 175000 --budget 0.05 \
        --bases channel,hadamard,hadamard_keys
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def main() -> None:
    import vlm_kv
    from vlm_kv.eval.fidelity import run_reference, text_tokens
    from vlm_kv.eval.teacher_forcing import feed_continuation
    from vlm_kv.models.smollm2 import load_smollm2

    p = argparse.ArgumentParser()
    p.add_argument("--text", required=True)
    p.add_argument("--offset", type=int, default=100000)
    p.add_argument("--budget", type=float, default=0.05)
    p.add_argument("--policy", default="dbtrimkv")
    p.add_argument("--bases", default="channel,hadamard,hadamard_keys")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--continuation", type=int, default=128)
    args = p.parse_args()
    model, tok = load_smollm2(torch.bfloat16)
    ids = text_tokens(tok, args.text, args.offset, args.context + args.continuation)
    ref, _ = run_reference(model, ids, args.context)
    kls = {}
    for basis in args.bases.split(","):
        cache = vlm_kv.make_cache(model, policy=args.policy, budget=args.budget, tiers={"basis": basis})
        logps = feed_continuation(model, cache, ids, args.context, label=basis).logps
        kls[basis] = F.kl_div(logps, ref, log_target=True, reduction="none").sum(-1)
    first = next(iter(kls.values()))
    for basis, kl in kls.items():
        top = kl.sort(descending=True).values
        print(json.dumps({"text": args.text.split("/")[-1], "offset": args.offset, "policy": args.policy,
                          "budget": args.budget, "basis": basis, "dtype": "bfloat16", "mean": round(float(kl.mean()), 4),
                          "median": round(float(kl.median()), 4), "top5": [round(float(x), 3) for x in top[:5]],
                          "mean_without_top3": round(float(top[3:].mean()), 4),
                          "tokens_worse_than_first": int((kl > first).sum()), "tokens": kl.numel()}))


if __name__ == "__main__":
    main()
