"""What each part of kvzip's read-back layout is worth: policy ``kvzip`` on the planted-fact trials
that kvpress's ``KVzipPress`` was run on (docs/retrieval/kvpress_kvzip/), one layout at a time.

    OMP_NUM_THREADS=1 python scripts/kvzip_readback_ablation.py \\
        --trials docs/retrieval/kvpress_kvzip/trials_later.json --budgets 0.05,0.1,0.25 \\
        --variants kvzip,global_softmax,no_reply_turn,chunk256,read_header \\
        --out docs/retrieval/kvzip_readback/ablation.json

Variants (``vlm_kv.reconstruction.ReadBack``; ``kvzip`` is the default layout, each other one
changes one thing): ``global_softmax`` (attention normalised over the whole cache, as our port did
until session 20), ``no_reply_turn`` (the instruction is not followed by the assistant's reply
header: a newline), ``chunk256`` (256-token chunks, the port's old size), ``read_header`` (the
chat template's header is read back too). The port before session 20 (global softmax, chunks of
256 whose read-backs stayed in the cache, no reply header, header read back) is in
docs/retrieval/fp32_later_kvzip.

Per trial the scores are computed once and every budget reuses them (they do not depend on it);
the context turn is prefilled into a ``kvzip`` cache, the question turn follows and up to 16 tokens
are generated greedily, scored like ``vlm-kv sweep --task retrieval``. Resumable: a variant already
in ``--out`` is skipped.

``--accounting`` says what a budget b is a share of. ``cache`` (vlm-kv's, as in every sweep): the
whole cache, so once the question and the answer are in, the cache holds b of everything and the
protected question and answer tokens leave fewer context entries (at 0.05 on a 1087-token context,
about 27 a head instead of 54). ``context`` (kvpress's: its compression ratio applies to the context
when it is compressed, and what follows is added on top): a token budget per head of
``round(b x context) + question tokens + 16``, so the context keeps b of itself to the end. The
variant's key in the JSON gets ``@context``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch
from tqdm import tqdm

import vlm_kv
from vlm_kv.api import cache_kwarg
from vlm_kv.eval.retrieval import score_answer
from vlm_kv.models.smollm2 import load_smollm2
from vlm_kv.reconstruction import ReadBack, plan_read_back, reconstruction_scores

VARIANTS = {
    "kvzip": ReadBack(),
    "global_softmax": ReadBack(local_softmax=False),
    "no_reply_turn": ReadBack(assistant_turn=False),
    "chunk256": ReadBack(chunk=256),
    "read_header": ReadBack(skip_template_prefix=False),
}
MAX_NEW = 16


@torch.no_grad()
def answer(model, tok, trial: dict, scores: list[torch.Tensor], budget: float, accounting: str) -> tuple[str, float]:
    ids = torch.tensor([trial["input_ids"]])
    ctx = torch.tensor([trial["context_ids"]])
    if accounting == "context":  # b of the context, then the question and the answer on top
        budget = round(budget * ctx.shape[1]) + ids.shape[1] - ctx.shape[1] + MAX_NEW
    cache = vlm_kv.make_cache(model, "kvzip", budget)
    cache.scorer.load_scores(scores)
    arg = {cache_kwarg(model): cache}
    model(input_ids=ctx, **arg, use_cache=True)
    held = cache.kv_bytes()["total"]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **arg, max_new_tokens=MAX_NEW,
                         do_sample=False, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip(), held


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", required=True)
    p.add_argument("--budgets", default="0.05,0.1,0.25")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--accounting", choices=("cache", "context"), default="cache")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with open(args.trials, encoding="utf-8") as fh:
        trials = json.load(fh)["trials"]
    done = {}
    if os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as fh:
            done = json.load(fh).get("variants", {})
    model, tok = load_smollm2()
    for name in names:
        key = name if args.accounting == "cache" else f"{name}@context"
        if key in done:
            continue
        settings = VARIANTS[name]
        t0 = time.perf_counter()
        records = []
        for trial in tqdm(trials, desc=name):
            ctx = torch.tensor([trial["context_ids"]])
            plan = plan_read_back(tok, ctx, settings)
            scores = reconstruction_scores(model, ctx, plan, local_softmax=settings.local_softmax)
            for budget in budgets:
                text, held = answer(model, tok, trial, scores, budget, args.accounting)
                records.append({"depth": trial["depth"], "trial": trial["trial"], "budget": budget,
                                "code": str(trial["code"]), "answer": text,
                                "correct": score_answer(text, str(trial["code"])), "kv_bytes": held})
        by_budget = {str(b): sum(r["correct"] for r in records if r["budget"] == b) for b in budgets}
        done[key] = {"read_back": dataclasses.asdict(settings), "accounting": args.accounting,
                     "correct": by_budget, "n": len(trials),
                      "seconds": round(time.perf_counter() - t0, 1), "records": records}
        print(key, by_budget, f"of {len(trials)}", flush=True)
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".tmp", "w", encoding="utf-8") as fh:
            json.dump({"trials_file": args.trials, "budgets": budgets, "max_new_tokens": MAX_NEW,
                       "torch_threads": torch.get_num_threads(), "variants": done}, fh, indent=1)
        os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
