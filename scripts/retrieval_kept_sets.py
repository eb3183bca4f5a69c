"""What a policy (``kvzip`` unless ``--policy`` says otherwise) keeps of a 2048-token retrieval trial at two budgets (issue 26).

On the later-turn trials at 2048 tokens kvzip answered fewer questions at 0.1 than at 0.05
(docs/retrieval.md, session 28). This reruns chosen trials and records, per budget, the answer,
the entries each layer holds after the answer, how many KV heads per layer still hold a token of
the planted code, and whether each head's kept positions at the larger budget contain those at the
smaller one. So it tells a kept-set defect (the larger budget dropping the fact) from a model that
answers worse with more context kept. ``--policy dbtrimkv --gates FOLDER`` asks the same of the
retention gates (session 30: the untiered 0.05 cell they lose to kvzip); the heads holding a token
of the fact's key (what the question names) are recorded too.

    OMP_NUM_THREADS=1 python scripts/retrieval_kept_sets.py --indices 1,3,18 --seed 1 \
        --out docs/retrieval/ctx2048/kvzip_kept_sets_seed1.json
    OMP_NUM_THREADS=1 python scripts/retrieval_kept_sets.py --policy dbtrimkv --gates docs/retrieval/gates/facts-aw05 \
        --seed 0 --indices 3,6,9 --out docs/retrieval/ctx2048/gates_kept_sets_seed0.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from vlm_kv.eval.retrieval import (
    RetrievalSettings,
    _answer,
    _prompt_ids,
    build_trials,
    score_answer,
)

from vlm_kv.api import make_cache
from vlm_kv.config import CacheOptions
from vlm_kv.models.named import load_model


def _kept(cache) -> list[list[set[int]]]:
    """Per layer, per KV head of row 0: the original positions held."""
    out = []
    for layer in cache.layers:
        pos, _ = layer.held_positions()
        out.append([set(pos[0, h][pos[0, h] >= 0].tolist()) for h in range(pos.shape[1])])
    return out


def _code_start(ids: list[int], code_ids: list[int], what: str = "the planted code") -> int:
    hits = [i for i in range(len(ids) - len(code_ids) + 1) if ids[i:i + len(code_ids)] == code_ids]
    if len(hits) != 1:
        raise ValueError(f"{what}'s tokens occur {len(hits)} times in the context, expected once")
    return hits[0]


def _key_positions(tok, ids: list[int], key: str, code_start: int) -> set[int]:
    """Positions of the key's tokens in the planted sentence: its last occurrence before the code
    (the key is tokenized with a leading space, as inside a sentence)."""
    key_ids = tok(" " + key, add_special_tokens=False).input_ids
    hits = [i for i in range(code_start - len(key_ids) + 1) if ids[i:i + len(key_ids)] == key_ids]
    if not hits:
        raise ValueError(f"the key {key!r} does not occur before the code in the context")
    return set(range(hits[-1], hits[-1] + len(key_ids)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--text", default="../shared/data/text/pg84.txt")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--offset", type=int, default=100000)
    ap.add_argument("--trials", type=int, default=8, help="trials a depth, as in the sweep (sets the trial list)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--indices", default="1,3,18", help="trial indices (depth-major order of the sweep's records)")
    ap.add_argument("--budgets", default="0.05,0.1")
    ap.add_argument("--policy", default="kvzip")
    ap.add_argument("--gates", default=None, help="for trimkv / dbtrimkv: a gates folder (default: the shipped set)")
    ap.add_argument("--scorer-kwargs", default=None, help="JSON of the scorer's fields, e.g. '{\"span\": 5}'")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(args.model)
    settings = RetrievalSettings(context=args.context, trials=args.trials, offset=args.offset, seed=args.seed,
                                 ask="later")
    specs = build_trials(tok, args.text, settings)
    budgets = [float(b) for b in args.budgets.split(",")]
    memo: dict = {}
    rows = []
    for idx in (int(i) for i in args.indices.split(",")):
        spec = specs[idx]
        enc = _prompt_ids(tok, spec, "later")
        code_ids = tok(spec["code"], add_special_tokens=False).input_ids
        start = _code_start(enc["context_ids"][0].tolist(), code_ids)
        code_pos = set(range(start, start + len(code_ids)))
        key_pos = _key_positions(tok, enc["context_ids"][0].tolist(), spec["key"], start)
        kept = {}
        row = {"index": idx, "depth": spec["depth"], "trial": spec["trial"], "code": spec["code"],
               "code_positions": sorted(code_pos), "key": spec["key"], "key_positions": sorted(key_pos), "context_tokens": int(enc["context_ids"].shape[1]), "budgets": {}}
        for b in budgets:
            options = CacheOptions(scorer_kwargs=json.loads(args.scorer_kwargs)) if args.scorer_kwargs else None
            cache = make_cache(model, policy=args.policy, budget=b, options=options,
                               **({"gates": args.gates} if args.gates else {}))
            answer = _answer(model, tok, enc, cache, 16, reconstruct=args.policy == "kvzip", memo=memo)
            kept[b] = _kept(cache)
            row["budgets"][str(b)] = {
                "answer": answer,
                "correct": score_answer(answer, spec["code"]),
                "entries_per_layer": [sum(len(h) for h in layer) for layer in kept[b]],
                "heads_with_code_token": [sum(bool(h & code_pos) for h in layer) for layer in kept[b]],
                "heads_with_whole_code": [sum(code_pos <= h for h in layer) for layer in kept[b]],
                "heads_with_key_token": [sum(bool(h & key_pos) for h in layer) for layer in kept[b]],
                "heads_with_key_and_code": [sum(bool(h & key_pos) and bool(h & code_pos) for h in layer)
                                            for layer in kept[b]],
            }
            print(idx, b, repr(answer), sum(row["budgets"][str(b)]["heads_with_code_token"]), flush=True)
        for lo, hi in itertools.pairwise(budgets):
            row[f"superset_{hi}_of_{lo}"] = all(a <= c for la, lc in zip(kept[lo], kept[hi]) for a, c in zip(la, lc))
        rows.append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
