"""A polykv strategy that gives each layer the share of the budget another policy's kept sets gave it.

Reads a kept-sets JSON of ``scripts/retrieval_kept_sets.py`` (entries each layer held after each
trial's answer, per budget), averages each layer's share of the held entries over the trials, and
writes a strategy with one pattern in every layer and phase (default ``dbtrimkv``: the gates choose
the entries inside each layer) and those shares as the layers' budgets. Why: on 2048-token
retrieval at 0.05, KVzip keeps facts the untiered gates lose while holding most of its budget in
six layers (docs/retrieval.md, session 29); this asks whether the gates do better with KVzip's
split between layers (docs/retrieval.md, session 34).

    python scripts/layer_profile_strategy.py runs/r34/kvzip_profile_pg1342.json --budget 0.05 \
        --base docs/polykv/smollm2_pg1342_b0.1.json --out runs/r34/kvzip_layers_strategy.json
"""

from __future__ import annotations

import argparse
import json

from vlm_kv.policies.strategy import LayerEntry, Strategy


def layer_shares(kept_sets: dict, budget: str) -> list[float]:
    """Each layer's mean share of the entries held, over the trials that ran at ``budget``."""
    rows = [r["budgets"][budget]["entries_per_layer"] for r in kept_sets["rows"] if budget in r["budgets"]]
    if not rows:
        raise SystemExit(f"no trial in the kept sets ran at budget {budget}")
    n = len(rows[0])
    shares = [0.0] * n
    for counts in rows:
        total = float(sum(counts))
        for i, c in enumerate(counts):
            shares[i] += c / total / len(rows)
    return shares


def profile_strategy(base: Strategy, shares: list[float], pattern: str, source: str) -> Strategy:
    if len(shares) != base.num_layers:
        raise SystemExit(f"the kept sets have {len(shares)} layers, the base strategy {base.num_layers}")
    cap = 1.0 / base.num_layers  # a layer cannot hold more than its whole cache
    # water-filling: a layer whose share exceeds its whole cache holds all of it, the rest is split
    # between the others in proportion to their shares
    budgets = [0.0] * len(shares)
    free = [i for i, s in enumerate(shares) if s > 0]
    left = base.budget
    while free:
        weight = sum(shares[i] for i in free)
        full = [i for i in free if left * shares[i] / weight > cap]
        if not full:
            for i in free:
                budgets[i] = left * shares[i] / weight
            break
        for i in full:
            budgets[i] = cap
            left -= cap
        free = [i for i in free if i not in full]
    layers = {phase: [LayerEntry(pattern, b, None, {"share_of_kept": s}) for b, s in zip(budgets, shares)]
              for phase in base.layers}
    return Strategy(model=dict(base.model), budget=base.budget, layers=layers, floor=0.0,
                    candidates=[pattern], calibration={"layer_shares_from": source}).validate()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kept_sets", help="a scripts/retrieval_kept_sets.py output")
    ap.add_argument("--budget", default="0.05", help="which budget's kept sets give the shares")
    ap.add_argument("--base", required=True, help="a strategy of the same model (its fingerprint and global budget)")
    ap.add_argument("--pattern", default="dbtrimkv")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.kept_sets) as f:
        kept = json.load(f)
    base = Strategy.load(args.base)
    strategy = profile_strategy(base, layer_shares(kept, args.budget), args.pattern, args.kept_sets)
    strategy.save(args.out)
    print(" ".join(f"{e.budget / strategy.budget:.3f}" for e in strategy.phase("prefill")))


if __name__ == "__main__":
    main()
