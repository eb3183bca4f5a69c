"""What an exact layer-by-layer prefill could hold for a tiered cache under a global ranking
(dbtrimkv + tiers), measured on a real prompt (issue 25; design in docs/tiered_prefill.md).

After layer l of a fresh prefill, an entry that is not protected and not among the top K scores of
the entries of layers 0..l (K = the FP entries the whole budget could pay for) can never be chosen
FP: later layers only add competitors. Such entries could go to INT2 at once (in a fresh prefill
an INT2 window keeps every entry it holds, so its codes would be the end-of-forward event's),
keeping FP copies only of the top K and the protected entries. This script takes the end-of-forward
event's own scores and reports, layer by layer, the bytes that would hold: FP copies + INT2 windows
of layers 0..l, plus layer l+1's whole prompt in FP (it is being computed), over the full cache.

    python scripts/tiered_prefill_bound.py --context 8192 --budget 0.1 [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import json

import torch

from vlm_kv.api import cache_kwarg, make_cache
from vlm_kv.cli.bench import bench_tokens
from vlm_kv.models.named import load_model
from vlm_kv.tiers import entry_router
from vlm_kv.tiers.groups import GroupBytes


def bound(layers, routings, allocation) -> dict:
    groups = GroupBytes.of(allocation, layers, routings)
    assert groups.count == 1, "one sequence under a global allocation"
    b_tok = layers[0].store.bytes_per_entry
    b_q = layers[0].tier.window_bytes()
    w = routings[0].window
    k = int(groups.budget[0]) // b_tok  # FP entries the whole budget pays for: a bound on the FP set
    full = sum(int(r.valid.sum()) for r in routings) * b_tok
    seen_scores = torch.empty(0, dtype=torch.float64)
    held_after = []
    for li, r in enumerate(routings):
        s = r.scores[r.valid].double()
        pinned = s == float("inf")
        seen_scores = torch.cat([seen_scores, s[~pinned]])
        kth = torch.topk(seen_scores, min(k, seen_scores.numel())).values[-1] if seen_scores.numel() > k else -float("inf")
        fp = 0
        int2_windows = 0
        for r2 in routings[: li + 1]:
            v = r2.valid
            sc = r2.scores
            keep_fp = v & ((sc == float("inf")) | (sc >= kth))
            fp += int(keep_fp.sum())
            demoted = v & ~keep_fp
            wid = r2.window_ids(r2.positions)
            B, H, L = sc.shape
            key = (torch.arange(B * H).view(B, H, 1) * (wid.max() + 1) + wid)[demoted]
            int2_windows += int(torch.unique(key).numel())
        nxt = int(routings[li + 1].valid.sum()) * b_tok if li + 1 < len(routings) else 0
        held_after.append((fp * b_tok + int2_windows * b_q + nxt) / full)
    return {"k_entries": k, "window": w, "b_tok": b_tok, "b_q": b_q, "peak_fraction": max(held_after),
            "per_layer": [round(x, 4) for x in held_after]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args()
    model, tok = load_model("smollm2", dtype=getattr(torch, args.dtype))
    ids = bench_tokens(tok, None, args.context)
    found = {}
    real = entry_router.EntryRouter.decide

    def spy(self, layers, routings, allocation, scorer):
        if not found:
            found.update(bound(layers, routings, allocation))
        return real(self, layers, routings, allocation, scorer)

    entry_router.EntryRouter.decide = spy
    cache = make_cache(model, "dbtrimkv", args.budget, tiers="int2")
    with torch.no_grad():
        model(input_ids=ids, **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=1)
    found.update(context=args.context, budget=args.budget, dtype=args.dtype,
                 held_after_routing=cache.kv_bytes()["total"] / cache.full_kv_bytes() if hasattr(cache, "kv_bytes") else None,
                 peak_now=cache.peak_kv_bytes / cache.full_kv_bytes())
    print(json.dumps(found))


if __name__ == "__main__":
    main()
