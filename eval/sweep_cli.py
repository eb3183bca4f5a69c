"""``vlm-kv sweep``: one task over policies x budgets, one results table and plots.

    vlm-kv sweep --task fidelity  --model smollm2 --text FILE --context 2048 --continuation 128 \\
                 --policies snapkv,streaming_llm,h2o --budgets 0.05,0.1,0.25,0.5 --out runs/sweep_fid
    vlm-kv sweep --task retrieval --model smollm2 --text FILE --context 1024 --depths 0.1,0.5,0.9 --trials 3 ...
    vlm-kv sweep --task mathvision --model VLM_DIR [--data DIR] [--limit N] ...
    vlm-kv sweep --task mmdu --model VLM_DIR --data FILE --images DIR (--judge DIR | --no-judge) ...
    vlm-kv sweep --task multimodal --model smollava --data-seed 1 --items 20 [--tasks single,multi_image,multi_turn] \
                 [--images real|noise] --policies snapkv,dbtrimkv --budgets 0.05,0.1,0.25 --out DIR

The full cache runs once as the reference. Rerunning with the same --out skips finished
(policy, budget) rows. Output: sweep_<task>.json / .csv and sweep_<task>_<metric>_vs_*.png in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from vlm_kv.api import check_cache_options
from vlm_kv.arguments.tier_flags import add_tier_args, tier_kwargs
from vlm_kv.config import BUDGET_HELP, CacheOptions
from vlm_kv.config import budget_arg as parse_budget
from vlm_kv.eval import sweep as sw
from vlm_kv.eval.mathvision_data import default_data_dir, load_problems
from vlm_kv.eval.mmdu_data import load_mmdu
from vlm_kv.eval.multimodal import MultimodalBench, MultimodalSettings
from vlm_kv.eval.multimodal import TASKS as MULTIMODAL_TASKS
from vlm_kv.eval.multimodal_sweep import run_multimodal_sweep
from vlm_kv.eval.retrieval import ASK_MODES, RetrievalSettings
from vlm_kv.eval.sweep import run_sweep
from vlm_kv.eval.sweep_table import FRACTION_AT_END
from vlm_kv.models.named import is_vlm, load_model, load_vlm, model_label
from vlm_kv.policies import FULL_POLICY, POLICIES

__all__ = ["register", "cmd_sweep", "parse_budget", "parse_list"]




def parse_list(text: str, item=str) -> list:
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return [item(x) for x in items]


def _budgets(text: str) -> list:
    return parse_list(text, parse_budget)


def _floats(text: str) -> list:
    try:
        return parse_list(text, float)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _policies(text: str) -> list[str]:
    names = parse_list(text)
    known = [FULL_POLICY, *POLICIES]
    bad = [n for n in names if n not in known]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown polic{'y' if len(bad) == 1 else 'ies'} {', '.join(bad)}; "
                                         f"known: {', '.join(known)}")
    if FULL_POLICY in names:  # it takes no budget, and every table has it
        raise argparse.ArgumentTypeError(f"'{FULL_POLICY}' is every sweep's reference row (budget 1.0); drop it "
                                         "from --policies")
    return names


def _fields_json(text: str, flag: str, of: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{flag} is not JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} takes a JSON object of the {of}'s fields, got {text!r}")
    return value


def _cache_kwargs(args) -> dict:
    kw = {}
    fields = {}
    if args.evict_every is not None:
        fields["evict_every"] = args.evict_every
    if getattr(args, "allocation_kwargs", None):
        fields["allocation_kwargs"] = _fields_json(args.allocation_kwargs, "--allocation-kwargs", "allocation")
    if getattr(args, "scorer_kwargs", None):
        fields["scorer_kwargs"] = _fields_json(args.scorer_kwargs, "--scorer-kwargs", "scorer")
    if fields:
        kw["options"] = CacheOptions(**fields)
    if args.gates:
        kw["gates"] = args.gates
    kw.update(tier_kwargs(args))
    if args.strategy:
        # the cache options go to every policy of the sweep, and only polykv takes a strategy
        others = [p for p in args.policies if p not in ("polykv", "full")]
        if others:
            raise ValueError(f"--strategy is for policy 'polykv'; sweep {', '.join(others)} without it")
        kw["strategy"] = args.strategy

    for policy in args.policies:  # every cell's settings, before any model loads
        for budget in getattr(args, "budgets", ()):
            check_cache_options(policy, budget, **kw)
    return kw


def _need(args, *names: str) -> None:
    missing = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n, None) in (None, "")]
    if missing:
        raise ValueError(f"sweep --task {args.task} needs {', '.join(missing)}")


def _text_model(args):
    return load_model(args.model, dtype=getattr(torch, args.dtype))


def _vlm_loader(args):
    if not is_vlm(args.model):
        raise ValueError(f"sweep --task {args.task} needs a VLM: --model smollava or a local VLM folder, "
                         f"got {args.model!r}")

    def load():
        return load_vlm(args.model, args.device)

    return load


def _text_model_name(args) -> str:
    # the dtype is part of what a resumed sweep must match
    return args.model if args.dtype == "float32" else f"{args.model} ({args.dtype})"


def build_task(args):
    """The sweep task object for parsed ``args`` (models load here or lazily in the task)."""

    progress = not args.no_progress
    kw = _cache_kwargs(args)
    if getattr(args, "diagnostics", False) and args.task != "fidelity":
        raise ValueError(f"--diagnostics is for --task fidelity, not {args.task}")
    if args.task in ("fidelity", "retrieval"):
        _need(args, "text")
        if not os.path.isfile(args.text):
            raise FileNotFoundError(f"text file not found: {args.text}")
        context = args.context if args.context is not None else (2048 if args.task == "fidelity" else 1024)
        model, tok = _text_model(args)
        if args.task == "fidelity":
            continuation = args.continuation if args.continuation is not None else 128
            return sw.FidelityTask(model, tok, args.text, context, continuation, offset=args.offset,
                                   model_name=_text_model_name(args), cache_kwargs=kw, progress=False,
                                   diagnostics=getattr(args, "diagnostics", False))
        settings = RetrievalSettings(context, tuple(args.depths), args.trials, args.offset, args.seed,
                                     args.max_new_tokens or 16, args.ask)
        return sw.RetrievalTask(model, tok, args.text, settings, model_name=_text_model_name(args), cache_kwargs=kw,
                                progress=False)
    if args.task == "mathvision":
        data = args.data or default_data_dir()
        if data is None:
            raise ValueError("sweep --task mathvision: give --data (testmini.jsonl + images/ folder, a .jsonl or "
                             "parquet files) or set VLM_KV_MATHVISION_DATA")
        problems = load_problems(data, split=args.split, limit=args.limit)
        return sw.MathVisionTask(_vlm_loader(args), problems, args.out, prompt_style=args.prompt,
                                 max_new_tokens=args.max_new_tokens or 4096, model_name=model_label(args.model),
                                 data=str(problems.source), cache_kwargs=kw, progress=progress)
    # mmdu

    _need(args, "data", "images")
    if not args.no_judge and not args.judge:
        raise ValueError("sweep --task mmdu: give --judge DIR (a local chat model folder) or --no-judge")
    if args.judge and not args.no_judge and not os.path.isdir(args.judge):
        raise FileNotFoundError(f"judge model folder not found: {args.judge}")
    data = load_mmdu(args.data, args.images, limit=args.limit)
    if not data.dialogs:
        raise ValueError(f"no MMDU dialogs loaded from {args.data}")
    judge = None if args.no_judge else args.judge
    return sw.MMDUTask(_vlm_loader(args), data, args.out, judge=judge,
                       judge_kwargs={"device": args.device, "max_new_tokens": args.judge_max_new_tokens},
                       max_new_tokens=args.max_new_tokens or 2048, model_name=model_label(args.model),
                       cache_kwargs=kw, progress=progress)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def cmd_multimodal(args: argparse.Namespace) -> int:
    """``--task multimodal``: rows per (policy, budget, task) of the generated visual tasks."""
    images = args.images or "real"
    settings = MultimodalSettings(data_seed=args.data_seed, items=args.items, tasks=tuple(args.tasks),
                                  images=images, max_new_tokens=args.max_new_tokens or 8)
    settings.validate()
    if not is_vlm(args.model):
        raise ValueError(f"sweep --task multimodal needs a VLM: --model smollava or a local VLM folder, "
                         f"got {args.model!r}")
    kw = _cache_kwargs(args)
    model, processor = load_vlm(args.model, args.device)
    bench = MultimodalBench(model, processor, settings, cache_kwargs=kw, progress=not args.no_progress,
                            reference_dir=args.reference_dir or args.out)
    rows = run_multimodal_sweep(bench, args.policies, args.budgets, args.out, model_name=model_label(args.model),
                                progress=not args.no_progress)
    header = ["task", "policy", "budget", "accuracy", "relative_accuracy", "kl", "visual_share", "kv_bytes"]
    lines = [header] + [[_fmt(r.get(k)) for k in header] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    for r in rows:
        if r.get("error"):
            print(f"sweep: {r['task']} {r['policy']}@{r['budget']}: {r['error']}", file=sys.stderr)
    print(f"sweep: table {args.out}/sweep_multimodal.json and .csv", file=sys.stderr)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    if args.task == "multimodal":
        return cmd_multimodal(args)
    task = build_task(args)
    result = run_sweep(task, args.policies, args.budgets, args.out, progress=not args.no_progress)
    keys = [m.key for m in task.metrics]
    header = ["policy", "budget", *keys, FRACTION_AT_END]
    lines = [header]
    if result.reference:
        lines.append(["full", "1.0", *[_fmt(result.reference.get(k)) for k in keys], "1"])
    for r in result.rows:
        lines.append([r["policy"], _fmt(r["budget"]), *[_fmt(r.get(k)) for k in keys],
                      "error" if r.get("error") else _fmt(r.get(FRACTION_AT_END))])
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(str(c).rjust(w) for c, w in zip(line, widths)))
    for key, err in result.errors:
        print(f"sweep: {key}: {err}", file=sys.stderr)
    print(f"sweep: {result.n_run} run(s) now, {result.n_skipped} already done; table {result.csv_path} "
          f"and {result.json_path}; {len(result.plots)} plot(s) in {args.out}", file=sys.stderr)
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Add the top-level ``sweep`` command to the main parser's subparsers."""
    p = subparsers.add_parser(
        "sweep",
        help="one task over policies x budgets: results table (CSV + JSON) and plots",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--task", required=True, choices=("fidelity", "retrieval", "mathvision", "mmdu", "multimodal"))
    p.add_argument("--model", default="smollm2",
                   help="'smollm2', 'smollava' or a local model folder (a VLM for mathvision / mmdu / multimodal)")
    p.add_argument("--policies", required=True, type=_policies, help="comma-separated policy names")
    p.add_argument("--budgets", required=True, type=_budgets,
                   help="comma-separated budgets, each " + BUDGET_HELP)
    p.add_argument("--out", required=True, help="output folder (reused to resume)")
    p.add_argument("--evict-every", type=int, default=None, help="decode steps between eviction steps")
    p.add_argument("--gates", default=None, help="retention gates folder for trimkv / dbtrimkv")
    p.add_argument("--allocation-kwargs", default=None,
                   help="JSON of the allocation's fields for every policy, e.g. "
                        "'{\"modality_floor\": {\"image\": 0.5}}' for dbtrimkv's global allocation")
    p.add_argument("--scorer-kwargs", default=None,
                   help="JSON of the scorer's fields for every policy, e.g. '{\"span\": 5}' for dbtrimkv's "
                        "retention scores pooled over 5 neighbouring entries")
    add_tier_args(p)
    p.add_argument("--strategy", default=None, help="strategy JSON for polykv (default: the one shipped for the model)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="generation length (default: retrieval 16, mathvision 4096, mmdu 2048)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    g = p.add_argument_group("fidelity / retrieval")
    g.add_argument("--text", default=None, help="plain UTF-8 text file")
    g.add_argument("--offset", type=int, default=0, help="character offset into the text")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="text model dtype (budgets are fractions of the full cache in the same dtype)")
    g.add_argument("--context", type=int, default=None,
                   help="tokens of text prefilled (default fidelity 2048, retrieval 1024)")
    g.add_argument("--continuation", type=int, default=None, help="fidelity: tokens fed one at a time (default 128)")
    g.add_argument("--diagnostics", action="store_true",
                   help="fidelity: add future missed mass, churn and LIR columns (docs/diagnostics.md)")
    g.add_argument("--depths", type=_floats, default=[0.1, 0.5, 0.9], help="retrieval: fact depths in [0, 1]")
    g.add_argument("--trials", type=int, default=3, help="retrieval: trials per depth")
    g.add_argument("--ask", choices=ASK_MODES, default="prompt",
                   help="retrieval: the question after the document in the prompt (prompt), or in a new turn "
                        "once the document was prefilled and compressed (later)")
    g.add_argument("--seed", type=int, default=0, help="retrieval: seed of the planted facts")
    g = p.add_argument_group("mathvision / mmdu")
    g.add_argument("--data", default=None, help="mathvision: data folder / file; mmdu: benchmark JSON")
    g.add_argument("--images", default=None, help="mmdu: folder the images archive was extracted to; multimodal: "
                   "real (default) or noise (pixels replaced by noise: the reads-its-images control)")
    g.add_argument("--limit", type=int, default=None, help="first N problems / dialogs")
    g.add_argument("--judge", default=None, help="mmdu: local judge model folder")
    g.add_argument("--no-judge", action="store_true", help="mmdu: ROUGE-L only")
    g.add_argument("--judge-max-new-tokens", type=int, default=1024)
    g.add_argument("--split", default="testmini", help="mathvision split when --data is a folder")
    g.add_argument("--prompt", choices=("authors", "lmms-eval"), default="authors", help="mathvision prompt style")
    g.add_argument("--device", default=None, help="cuda / cpu for VLM tasks (default: cuda when available)")
    g = p.add_argument_group("multimodal (generated visual tasks)")
    g.add_argument("--data-seed", type=int, default=1,
                   help="generator seed of the items (smollava trained on seed 0: any other seed is held out)")
    g.add_argument("--items", type=int, default=20, help="items per task")
    g.add_argument("--tasks", type=parse_list, default=list(MULTIMODAL_TASKS),
                   help=f"comma-separated, of {', '.join(MULTIMODAL_TASKS)}")
    g.add_argument("--reference-dir", default=None,
                   help="folder keeping the full cache's pass per task (answers and log-probs), reused by any sweep "
                        "of the same items, model and dtype (default: --out; name one folder to share it between "
                        "sweeps with other cache settings)")
    p.set_defaults(func=cmd_sweep)
    return p
