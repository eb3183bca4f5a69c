"""``vlm-kv eval mmdu``: MMDU dialogs on a compressed cache, judged by a local model."""

from __future__ import annotations

import torch

from vlm_kv.arguments.tier_flags import add_tier_args, tier_kwargs
from vlm_kv.eval.benchmark_args import (
    add_num_processes,
    add_pixel_limits,
    relaunch_args,
)
from vlm_kv.eval.mmdu_data import load_mmdu
from vlm_kv.eval.mmdu_judge import LocalJudge, judge_name
from vlm_kv.eval.mmdu_run import generate_answers, judge_answers, summarize
from vlm_kv.eval.shard import current_shard, generate_answers_sharded, launch

DESCRIPTION = """\
    vlm-kv eval mmdu --model PATH --data FILE --images DIR --judge PATH --policy NAME --budget F
             [--limit N] [--out DIR] [--max-new-tokens N] [--no-judge]

Answers every dialog turn by turn on one (compressed) cache per dialog, then frees the model,
loads the judge from its folder and judges each question; see ``vlm_kv.eval.mmdu_run``.
Rerunning with the same --out resumes: finished dialogs are skipped.
"""


import argparse
import gc
import json
import os
import sys
from functools import partial

from vlm_kv.config import BUDGET_HELP
from vlm_kv.config import budget_arg as parse_budget
from vlm_kv.models.named import load_vlm, model_label  # module attribute: tests replace it


def _default_out(args) -> str:
    model = os.path.basename(os.path.normpath(args.model)) or "model"
    return os.path.join("runs", "mmdu", f"{model}_{args.policy}_{args.budget}")


def cmd_mmdu(args: argparse.Namespace) -> int:
    relaunch = relaunch_args(args)
    if relaunch is not None:
        return launch(args.num_processes, relaunch)
    if not args.no_judge and not args.judge:
        print("mmdu: give --judge PATH (a local chat model folder) or --no-judge", file=sys.stderr)
        return 2
    if not args.no_judge and not os.path.isdir(args.judge):
        print(f"mmdu: judge folder not found: {args.judge}", file=sys.stderr)
        return 2
    data = load_mmdu(args.data, args.images, limit=args.limit)
    if not data.dialogs:
        print(f"mmdu: no dialogs loaded from {args.data}: {[p.to_dict() for p in data.problems]}", file=sys.stderr)
        return 1
    s = data.summary()
    print(
        f"MMDU: {s['n_dialogs']} dialogs, {s['n_questions']} questions "
        f"({s['n_unrunnable_questions']} unrunnable; problems {s['problem_counts']})",
        file=sys.stderr,
    )
    out = args.out or _default_out(args)
    config = {"model": model_label(args.model), "data": os.path.abspath(args.data), "images": args.images}

    # 1. answers (the VLM), 2. free it, 3. judge (both rarely fit in memory at once)
    shard = current_shard()
    model, processor = load_vlm(args.model, args.device or shard.device)
    answer = generate_answers if shard.world == 1 else partial(generate_answers_sharded, shard=shard)
    counts = answer(
        model, processor, data, out,
        policy=args.policy, budget=args.budget, max_new_tokens=args.max_new_tokens, config=config,
        min_pixels=args.min_pixels, max_pixels=args.max_pixels,
        cache_kwargs={**tier_kwargs(args), **({"strategy": args.strategy} if args.strategy else {})} or None,
    )
    if counts is None:  # a non-main process of a sharded run: the main one merged, judges and reports
        return 0
    del model, processor
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    judge_info = None
    if not args.no_judge:
        judge = LocalJudge(args.judge, device=args.device, max_new_tokens=args.judge_max_new_tokens)
        judge_info = judge_name(judge)
        counts.update(judge_answers(judge, out, dialog_ids=[d.id for d in data.dialogs]))
    summary = summarize(out, data, judge_info=judge_info, extra={"counts": counts})
    keys = ("judge", "scores", "n_judged", "n_parse_failures", "rouge_l", "policy", "budget", "kv_bytes", "n_skipped")
    print(json.dumps({k: summary.get(k) for k in keys}, indent=2, default=str))
    print(f"results in {out}", file=sys.stderr)
    return 0


def register(eval_subparsers) -> argparse.ArgumentParser:
    """Add the ``mmdu`` sub-command to an ``add_subparsers()`` object."""
    p = eval_subparsers.add_parser(
        "mmdu",
        help="MMDU multi-turn multi-image dialogs on a compressed cache, judged by a local model",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="local folder of a transformers VLM (and its processor)")
    p.add_argument("--data", required=True, help="MMDU benchmark JSON (object keyed by dialog id)")
    p.add_argument("--images", required=True, help="folder the images archive was extracted to")
    p.add_argument("--judge", default=None, help="local folder of a transformers chat model used as judge")
    p.add_argument("--policy", required=True, help="cache policy for vlm_kv.make_cache ('full' = no compression)")
    p.add_argument("--strategy", default=None, help="strategy JSON for policy polykv")
    p.add_argument("--budget", type=parse_budget, required=True,
                   help=BUDGET_HELP)
    p.add_argument("--limit", type=int, default=None, help="first N dialogs only")
    p.add_argument("--out", default=None, help="results folder (default runs/mmdu/<model>_<policy>_<budget>)")
    p.add_argument("--max-new-tokens", type=int, default=2048, help="per answer (the MMDU authors use 2048)")
    p.add_argument("--no-judge", action="store_true", help="answers and ROUGE-L only")
    p.add_argument("--judge-max-new-tokens", type=int, default=1024, help="judge reply length")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")

    add_pixel_limits(p)
    add_num_processes(p)

    add_tier_args(p)
    p.set_defaults(func=cmd_mmdu, parser=p)
    return p
