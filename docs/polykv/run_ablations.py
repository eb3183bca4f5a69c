"""PolyKV ablations on SmolLM2 (one shared full-cache reference for every row):

    python docs/polykv/run_ablations.py --strategy vlm_kv/strategies/smollm2-135m-pg1342-b0.1.json \
        --text /work/shared/data/text/pg84.txt --offset 100000 --context 2048 --continuation 128 \
        --budgets 0.1,0.05,0.25 --out docs/polykv/ablations.jsonl

Rows per budget: polykv (patterns + budgets), patterns only (uniform budgets), budgets only
(one pattern, --single), and the uniform baseline policy (--baseline). Rows already in --out
are skipped, so an interrupted run resumes.
"""
import argparse
import json
import os

import torch

from vlm_kv.api import make_cache
from vlm_kv.eval.fidelity import measure, run_reference, text_tokens
from vlm_kv.models.smollm2 import load_model
from vlm_kv.policies.strategy import Strategy


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", required=True)
    p.add_argument("--text", required=True)
    p.add_argument("--offset", type=int, default=100000)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--continuation", type=int, default=128)
    p.add_argument("--budgets", default="0.1")
    p.add_argument("--single", default="adakv", help="the one pattern of the budgets-only row")
    p.add_argument("--baseline", default="adakv", help="uniform policy compared against")
    p.add_argument("--rows", default="polykv,baseline,patterns_only,budgets_only")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    model, tok = load_model("smollm2")
    strategy = Strategy.load(args.strategy, model=model)
    done = set()
    if os.path.isfile(args.out):
        with open(args.out) as fh:
            done = {(r["row"], r["budget"]) for r in map(json.loads, fh)}
    ids = text_tokens(tok, args.text, args.offset, args.context + args.continuation + 1)
    reference = None
    variants = {
        "polykv": lambda: strategy,
        "patterns_only": strategy.with_uniform_budgets,
        "budgets_only": lambda: strategy.with_pattern(args.single),
    }
    for budget in [float(b) for b in args.budgets.split(",")]:
        for row in args.rows.split(","):
            if (row, budget) in done:
                continue
            if reference is None:
                reference = run_reference(model, ids, args.context)
            if row == "baseline":
                factory = lambda: make_cache(model, policy=args.baseline, budget=budget)
                name = args.baseline
            else:
                s = variants[row]()
                factory = lambda s=s: make_cache(model, policy="polykv", budget=budget, strategy=s)
                name = f"polykv:{row}"
            with torch.no_grad():
                r = measure(model, ids, args.context, name, budget, reference, cache_factory=factory)
            out = dict(row=row, **r.json_fields())
            print(json.dumps(out), flush=True)
            with open(args.out, "a") as fh:
                fh.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
