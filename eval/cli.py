"""``vlm-kv eval ...`` sub-commands.

    vlm-kv eval mathvision-score --problems FILE --responses FILE [--out FILE]
    vlm-kv eval mathvision --model PATH --policy NAME --budget F [--limit N] [--out DIR]
                           [--prompt authors|lmms-eval] [--max-new-tokens N] [--data DIR]

``register(subparsers)`` adds the ``eval`` command to the main parser; other
benchmarks plug in through their own ``register(eval_subparsers)`` (MMDU:
``vlm_kv.eval.mmdu_cli``).  Every sub-command sets ``func``; the main CLI
calls ``args.func(args)``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path

from vlm_kv.arguments.subcommands import add_unavailable
from vlm_kv.arguments.tier_flags import add_tier_args, tier_kwargs
from vlm_kv.config import BUDGET_HELP
from vlm_kv.config import budget_arg as parse_budget
from vlm_kv.eval.benchmark_args import (
    add_num_processes,
    add_pixel_limits,
    relaunch_args,
)
from vlm_kv.eval.mathvision_data import default_data_dir, load_problems
from vlm_kv.eval.mathvision_run import RESULT_FILE, run_mathvision
from vlm_kv.eval.mathvision_score import (
    have_latex2sympy,
    read_jsonl_rows,
    score_responses,
)
from vlm_kv.eval.shard import current_shard, launch, run_mathvision_sharded
from vlm_kv.models.named import load_vlm

__all__ = ["parse_budget", "register"]




# --------------------------------------------------------------------------
# mathvision-score
# --------------------------------------------------------------------------


def cmd_mathvision_score(args: argparse.Namespace) -> int:
    problems = load_problems(args.problems, split=args.split, require_images=False)
    rows, bad_lines = read_jsonl_rows(args.responses)
    for err in bad_lines[:10]:
        print(f"mathvision-score: {args.responses}: {err}", file=sys.stderr)
    if not have_latex2sympy():
        print("mathvision-score: latex2sympy2 is not installed; equality falls back to plain "
              "number comparison (pip install latex2sympy2)", file=sys.stderr)
    report = score_responses(problems, rows, workers=args.workers)

    text = json.dumps(report.result, indent=4, ensure_ascii=False)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text, encoding="utf-8")  # byte-for-byte as the authors write it
    if args.items_out:
        Path(args.items_out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.items_out, "w", encoding="utf-8") as fh:
            for item in report.items:
                fh.write(json.dumps(item.to_json(), ensure_ascii=False) + "\n")
    print(text)

    n_items = len(report.items)
    print(
        f"mathvision-score: {n_items} response rows, {report.n_correct} correct, "
        f"{report.n_errors} with errors, {len(bad_lines)} unreadable line(s); "
        f"{problems.n_errors} malformed problem row(s); "
        f"{len(report.missing)} problem(s) without a response",
        file=sys.stderr,
    )
    for item in [it for it in report.items if it.error][:10]:
        print(f"  {item.id or '?'}: {item.error}", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------
# mathvision (generation)
# --------------------------------------------------------------------------


def _default_out(args: argparse.Namespace) -> str:
    model = os.path.basename(os.path.normpath(args.model)) or "model"
    return os.path.join("runs", "mathvision", f"{model}_{args.policy}_{args.budget}_{args.prompt}")


def cmd_mathvision(args: argparse.Namespace) -> int:
    relaunch = relaunch_args(args)
    if relaunch is not None:
        return launch(args.num_processes, relaunch)

    data = args.data or default_data_dir()
    if data is None:
        print("mathvision: give --data (a folder with testmini.jsonl + images/, a .jsonl, or "
              "Hugging Face parquet files), or set VLM_KV_MATHVISION_DATA", file=sys.stderr)
        return 2
    problems = load_problems(data, split=args.split, limit=args.limit)
    if problems.n_errors:
        print(f"mathvision: {problems.n_errors} of {len(problems)} problem(s) unusable "
              "(recorded as errors):", file=sys.stderr)
        for pid, err in problems.errors[:10]:
            print(f"  {pid}: {err}", file=sys.stderr)

    shard = current_shard()
    model, processor = load_vlm(args.model, args.device or shard.device, args.dtype)
    out_dir = args.out or _default_out(args)
    run = run_mathvision if shard.world == 1 else partial(run_mathvision_sharded, shard=shard)
    summary = run(
        model,
        processor,
        problems,
        policy=args.policy,
        budget=args.budget,
        out_dir=out_dir,
        prompt_style=args.prompt,
        max_new_tokens=args.max_new_tokens,
        retry_errors=args.retry_errors,
        progress=not args.no_progress,
        config_extra={"model": args.model, "data": problems.source, "split": args.split},
        min_pixels=args.min_pixels,
        max_pixels=args.max_pixels,
        cache_kwargs={**tier_kwargs(args), **({"strategy": args.strategy} if args.strategy else {})} or None,
    )
    if summary is None:  # a non-main process of a sharded run: the main one merged and reports
        return 0
    print(json.dumps(summary.result, indent=4, ensure_ascii=False))
    print(
        f"mathvision: {summary.n_problems} problems ({summary.n_generated} generated now, "
        f"{summary.n_skipped} already done), {summary.n_correct} correct, {summary.n_errors} with errors; "
        f"prompt {args.prompt!r}; results in {Path(out_dir) / RESULT_FILE}",
        file=sys.stderr,
    )
    if summary.n_errors and not args.retry_errors:
        print("mathvision: rerun with --retry-errors to try the failed problems again", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------
# registration
# --------------------------------------------------------------------------


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``eval`` command (and its sub-commands) to ``subparsers``."""
    eval_parser = subparsers.add_parser("eval", help="benchmarks: MathVision (and MMDU when installed)")
    eval_sub = eval_parser.add_subparsers(dest="eval_command", metavar="BENCHMARK")
    eval_sub.required = True

    p = eval_sub.add_parser(
        "mathvision-score",
        help="re-score MathVision responses with the authors' rules; prints the aggregate JSON",
        description="Re-extract the answer from each row's 'response' (any stored verdict is ignored), "
        "judge it with the authors' rules and print the aggregate in their result format.",
    )
    p.add_argument("--problems", required=True,
                   help="problems: a .jsonl, a .parquet, or a folder holding {split}.jsonl / parquet")
    p.add_argument("--responses", required=True, help="JSONL with 'id' and 'response' per line")
    p.add_argument("--out", default=None, help="also write the aggregate JSON to this file")
    p.add_argument("--items-out", default=None, help="write the per-row re-scoring (JSONL) to this file")
    p.add_argument("--split", default="test", help="split file to use when --problems is a folder (default test)")
    p.add_argument("--workers", type=int, default=1, help="processes for scoring (LaTeX parsing is slow)")
    p.set_defaults(func=cmd_mathvision_score)

    p = eval_sub.add_parser(
        "mathvision",
        help="generate MathVision answers on a compressed cache and score them",
    )
    p.add_argument("--model", required=True, help="local folder of a transformers VLM (and its processor)")
    p.add_argument("--policy", required=True, help="cache policy for vlm_kv.make_cache ('full' = no compression)")
    p.add_argument("--strategy", default=None, help="strategy JSON for policy polykv")
    p.add_argument("--budget", type=parse_budget, required=True,
                   help=BUDGET_HELP)
    p.add_argument("--limit", type=int, default=None, help="first N problems only")
    p.add_argument("--out", default=None,
                   help="output folder (default runs/mathvision/<model>_<policy>_<budget>_<prompt>)")
    p.add_argument("--prompt", choices=("authors", "lmms-eval"), default="authors",
                   help="prompt style (default: the authors' chain-of-thought prompt)")
    p.add_argument("--max-new-tokens", type=int, default=4096)
    p.add_argument("--data", default=None,
                   help="folder with {split}.jsonl + images/ or HF parquet files, or a .jsonl/.parquet "
                   "(default: $VLM_KV_MATHVISION_DATA or shared/data/mathvision above the working dir)")
    p.add_argument("--split", default="testmini", help="split when --data is a folder (default testmini)")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    p.add_argument("--dtype", default="auto", help="model dtype: auto (bf16/fp16 per config on GPU, fp32 on CPU), "
                   "bfloat16, float16, float32")
    p.add_argument("--retry-errors", action="store_true", help="run again the problems recorded with an error")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_pixel_limits(p)
    add_num_processes(p)
    add_tier_args(p)
    p.set_defaults(func=cmd_mathvision, parser=p)

    try:
        from vlm_kv.eval import mmdu_cli
    except ImportError as exc:  # shown as unavailable, with the reason, rather than hidden
        add_unavailable(eval_sub, "mmdu", "vlm_kv.eval.mmdu_cli", exc)
    else:
        mmdu_cli.register(eval_sub)
    return eval_parser
