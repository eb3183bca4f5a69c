"""``vlm-kv`` command line: demo, fidelity, bench, policies, eval (and the gate tools)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

import torch

from vlm_kv.api import check_cache_options
from vlm_kv.arguments.checks import check_text_file
from vlm_kv.arguments.subcommands import add_unavailable, run_command
from vlm_kv.arguments.tier_flags import add_tier_args, tier_kwargs
from vlm_kv.cli.bench import BenchPlan, bench, bench_interleaved, bench_isolated, plot_rows
from vlm_kv.cli.demo import run_demo
from vlm_kv.cli.demo_image import ImageDemoSettings, run_image_demo
from vlm_kv.config import BUDGET_HELP, CacheOptions, budget_value
from vlm_kv.eval.diagnostics import check_params, diagnose, format_table, plot
from vlm_kv.eval.fidelity import fidelity, text_span
from vlm_kv.gates.io import load_config
from vlm_kv.models.named import check_model, load_model
from vlm_kv.policies import POLICIES, normalize_policy_name


def _load(model: str, dtype: str = "float32", device: str = "cpu"):
    loaded, tok = load_model(model, dtype=getattr(torch, dtype))
    return loaded.to(device), tok


def _check_policy(policy: str, gates: str | None) -> str:
    key = normalize_policy_name(policy)
    if gates:
        load_config(gates)  # a missing or corrupt gate folder fails here, not after the model loads
    return key


def _check_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here")


def _csv(kind, text: str) -> list:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"empty list: {text!r}")
    return [kind(t) for t in items]


def _check_span(args: argparse.Namespace, continuation: int) -> None:
    """--context / --continuation / --offset against the text, before any model loads."""

    for name, value in (("--context", args.context), ("--continuation", continuation)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1 token, got {value}")
    check_text_file(args.text)
    text_span(args.text, args.offset, args.context + continuation + 1)


def cmd_fidelity(args: argparse.Namespace) -> int:
    budget = budget_value(args.budget)
    policy = _check_policy(args.policy, args.gates)
    _check_span(args, args.continuation)
    check_model(args.model)
    kwargs = dict(tier_kwargs(args), options=CacheOptions(evict_every=args.evict_every,
                                                           prefill_chunk=args.prefill_chunk))
    if args.gates:
        kwargs["gates"] = args.gates
    if args.strategy:
        kwargs["strategy"] = args.strategy
    check_cache_options(policy, budget, **kwargs)
    model, tok = _load(args.model, args.dtype)
    (result,) = fidelity(
        model, tok, args.text, args.context, args.continuation, [(policy, budget)],
        offset=args.offset, progress=not args.json, **kwargs,
    )
    if args.json:
        print(json.dumps(dict(result.json_fields(), prefill_chunk=args.prefill_chunk, dtype=args.dtype,
                              tiers=args.tiers, int2_share=args.int2_share, int2_value=args.int2_value,
                              window=args.window, key_rope=args.key_rope, fp_unit=args.fp_unit,
                              key_grid=args.key_grid, basis=args.basis)))
    else:
        r = result
        print(f"policy {r.policy}  budget {r.budget}  context {r.context}  continuation {r.continuation}")
        print(f"  KL(full||compressed) {r.kl:.4f}   top-1 agreement {r.top1:.3f}")
        print(f"  NLL {r.nll:.4f} (full cache {r.full_nll:.4f})")
        print(f"  KV bytes (keys/values) {r.kv_bytes:,} / full cache {r.full_kv_bytes:,}  (most after an eviction step "
              f"{r.max_kv_bytes:,}); everything held, bookkeeping included {r.held_bytes:,}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    contexts = _csv(int, args.contexts)
    policies = [_check_policy(p, None) for p in _csv(str, args.policies)]
    budgets = [budget_value(b) for b in _csv(str, args.budgets)]
    if any(c < 2 for c in contexts):
        raise ValueError(f"--contexts must be >= 2 tokens, got {args.contexts}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
    if args.steps < 1 or args.repeats < 1:
        raise ValueError(f"--steps and --repeats must be >= 1, got {args.steps} and {args.repeats}")
    if args.evict_every is not None and args.evict_every < 1:
        raise ValueError(f"--evict-every must be >= 1, got {args.evict_every}")
    if args.strategy and "polykv" not in policies:
        raise ValueError("--strategy is for policy 'polykv'; add polykv to --policies")
    check_text_file(args.text)
    _check_device(args.device)
    check_model(args.model)
    plan = BenchPlan(tuple(contexts), tuple(policies), tuple(budgets), text_path=args.text, steps=args.steps,
                     repeats=args.repeats, prefill_chunk=args.prefill_chunk, strategy=args.strategy,
                     tiers=tier_kwargs(args).get("tiers"), layerwise_prefill=not args.prefill_at_end,
                     evict_every=args.evict_every)
    for policy in policies:  # DynamicCache runs anyway; "full" takes no budget
        strategy = plan.strategy if policy == "polykv" else None
        for budget in budgets if policy != "full" else ():
            check_cache_options(policy, budget, tiers=plan.tiers, strategy=strategy, options=plan.options())
    if args.interleave or args.in_process:
        if not args.json:
            print(f"Loading {args.model} ({args.dtype}, {args.device}) ...", flush=True)
        model, tok = _load(args.model, args.dtype, args.device)
        runs = (bench_interleaved if args.interleave else bench)(model, tok, plan, progress=not args.json)
    else:
        runs = bench_isolated(args.model, args.dtype, args.device, plan, progress=not args.json)
    rows = []
    if not args.json:
        print(f"{'cache':>22} {'context':>7} {'prefill s':>9} {'ms/token':>9} {'tok/s':>7} {'evict':>6} "
              f"{'KV prefill MiB':>14} {'KV decode MiB':>13} {'peak mem MiB':>12}")
    for row in runs:
        rows.append(row)
        if args.json:
            print(json.dumps(row.as_dict()), flush=True)
        else:
            name = "DynamicCache" if row.policy == "full" else f"{row.policy}@{row.budget}"
            print(f"{name:>22} {row.context:>7} {row.prefill_s:>9.2f} {row.decode_ms_per_token:>9.2f} "
                  f"{row.tokens_per_s:>7.1f} {row.evict_share:>6.1%} {row.peak_kv_bytes_prefill / 2**20:>14.2f} "
                  f"{row.peak_kv_bytes_decode / 2**20:>13.2f} {row.peak_memory_bytes / 2**20:>12.1f}", flush=True)
    if args.plot:
        plot_rows(rows, args.plot)
        if not args.json:
            print(f"plot: {args.plot}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    image_only = {"--png": args.png, "--data-seed": args.data_seed, "--images": args.images}
    if not args.image:
        given = [flag for flag, value in image_only.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: only with --image (the image question on smollava)")
        budget = budget_value(args.budget)
        policy = _check_policy(args.policy or "dbtrimkv", args.gates)
        check_cache_options(policy, budget, gates=args.gates, strategy=args.strategy)
        check_model("smollm2")
        max_new_tokens = 48 if args.max_new_tokens is None else args.max_new_tokens
        return run_demo(policy=policy, budget=budget, max_new_tokens=max_new_tokens, gates=args.gates,
                        strategy=args.strategy)
    # defaults live here, not in the parser, so that the text demo keeps its own (dbtrimkv, 48 tokens)
    settings = ImageDemoSettings(
        policy=_check_policy(args.policy or ImageDemoSettings.policy, args.gates), budget=budget_value(args.budget),
        data_seed=1 if args.data_seed is None else args.data_seed, images=4 if args.images is None else args.images,
        max_new_tokens=ImageDemoSettings.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens,
        png=args.png or "vlm_kv_demo.png", gates=args.gates, strategy=args.strategy)
    settings.validate()  # every argument before the model loads
    check_model("smollava")
    run_image_demo(settings)
    return 0


def cmd_policies(args: argparse.Namespace) -> int:
    for name, spec in POLICIES.items():
        print(f"{name:>14}  {spec.description}")
    return 0


def _add_text_args(p: argparse.ArgumentParser, context: int) -> None:
    p.add_argument("--model", default="smollm2", help="'smollm2' (the real SmolLM2-135M-Instruct) or a local model folder")
    p.add_argument("--text", required=True, help="plain UTF-8 text file")
    p.add_argument("--offset", type=int, default=0, help="character offset to start reading the text at")
    p.add_argument("--context", type=int, default=context, help="tokens prefilled with the policy")


# ---- diagnose: FMM / churn / LIR of eviction and tiering decisions (eval/diagnostics.py)
def cmd_diagnose(args: argparse.Namespace) -> int:
    budget = budget_value(args.budget)
    policy = _check_policy(args.policy, None)
    check_params(context=args.context, continuation=args.continuation, horizon=args.horizon,
                 window=args.window, lir_m=args.lir_m)
    if args.evict_every is not None and args.evict_every < 1:
        raise ValueError(f"--evict-every must be >= 1, got {args.evict_every}")
    kwargs = dict(tier_kwargs(args, window=False), options=CacheOptions(evict_every=args.evict_every))
    if kwargs.get("tiers"):  # diagnose's --window is the tiers' window too (diagnose puts it there)
        given = kwargs["tiers"] if isinstance(kwargs["tiers"], dict) else {}
        check_cache_options(policy, budget, **dict(kwargs, tiers={**given, "window": args.window}))
    else:
        check_cache_options(policy, budget, **kwargs)
    _check_span(args, args.continuation)
    check_model(args.model)
    model, tok = _load(args.model, args.dtype)
    result = diagnose(model, tok, args.text, policy, budget, offset=args.offset, context=args.context,
                      continuation=args.continuation, horizon=args.horizon, window=args.window,
                      lir_m=args.lir_m, progress=True, **kwargs)
    result.params.update(model=args.model, dtype=args.dtype)
    print(json.dumps(result.as_dict()) if args.json else format_table(result))
    if args.plot:
        plot(result, args.plot)
        if not args.json:
            print(f"plot: {args.plot}")
    return 0


def _add_diagnose_parser(sub) -> None:
    p = sub.add_parser("diagnose", help="future missed mass, selection churn and LIR of a policy vs the full cache")
    _add_text_args(p, 2048)
    p.add_argument("--continuation", type=int, default=128, help="tokens fed one at a time after the prefill")
    p.add_argument("--policy", required=True)
    p.add_argument("--budget", required=True, help=BUDGET_HELP)
    p.add_argument("--horizon", type=int, default=32, help="decode steps after each event that FMM and LIR look at")
    p.add_argument("--window", type=int, default=8, help="tokens per window (window id = position // window)")
    p.add_argument("--lir-m", type=int, default=2, help="consecutive events out of full precision before a window counts as latent")
    p.add_argument("--evict-every", type=int, default=None, help="decode steps between eviction steps (default: 16, or the tier window with --tiers)")
    add_tier_args(p, window=False)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", default=None, help="write a PNG: FMM and churn per event vs decode step")
    p.set_defaults(func=cmd_diagnose)
# ---- end diagnose


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlm-kv", description="Compressed KV caches for VLMs and LLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_diagnose_parser(sub)

    p = sub.add_parser("demo", help="SmolLM2 answers two turns of questions about a long text, full vs compressed "
                                     "cache; --image: smollava answers a question about one of several images")
    p.add_argument("--policy", default=None,
                   help="default: dbtrimkv (the learned gates shipped for SmolLM2, or for smollava with --image)")
    p.add_argument("--budget", default="0.25", help=BUDGET_HELP)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 48 (16 with --image)")
    p.add_argument("--gates", default=None, help="gate folder for trimkv/dbtrimkv (default: the gates shipped for the model)")
    p.add_argument("--strategy", default=None, help="strategy JSON for polykv (default: the one shipped for SmolLM2)")
    p.add_argument("--image", action="store_true",
                   help="ask smollava a held-out question about one of several generated images instead, and "
                        "draw the image patches the compressed cache kept")
    p.add_argument("--png", default=None, help="with --image: where to write the kept-patch PNG (default vlm_kv_demo.png)")
    p.add_argument("--data-seed", type=int, default=None,
                   help="with --image: data seed of the generated item (default 1; training used seed 0 only)")
    p.add_argument("--images", type=int, default=None, help="with --image: images in the context (default 4)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("fidelity", help="KL / top-1 / NLL of a compressed cache vs the full cache on real text")
    _add_text_args(p, 2048)
    p.add_argument("--continuation", type=int, required=True, help="tokens fed one at a time after the prefill")
    p.add_argument("--policy", required=True)
    p.add_argument("--budget", required=True, help=BUDGET_HELP)
    p.add_argument("--evict-every", type=int, default=None, help="decode steps between eviction steps (default: 16, or the tier window with --tiers)")
    p.add_argument("--gates", default=None, help="gate folder for trimkv/dbtrimkv (default: the gates shipped for the model)")
    p.add_argument("--prefill-chunk", type=int, default=None, help="prefill the context in chunks of N tokens, evicting between chunks")
    p.add_argument("--strategy", default=None, help="strategy JSON for polykv (default: the one shipped for SmolLM2)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    add_tier_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.set_defaults(func=cmd_fidelity)

    p = sub.add_parser("bench", help="prefill/decode speed and memory: compressed caches vs DynamicCache")
    p.add_argument("--model", default="smollm2", help="'smollm2' (the real SmolLM2-135M-Instruct) or a local model folder")
    p.add_argument("--text", default=None, help="plain UTF-8 text (default: the embedded letter, repeated to length)")
    p.add_argument("--contexts", default="2048,4096,8192", help="comma-separated prefill lengths")
    p.add_argument("--policies", default="snapkv,dbtrimkv", help="comma-separated policies (DynamicCache always runs too)")
    p.add_argument("--budgets", default="0.1", help="comma-separated budgets, each " + BUDGET_HELP)
    p.add_argument("--prefill-chunk", type=int, default=None, help="prefill in chunks of N tokens, evicting between chunks")
    p.add_argument("--prefill-at-end", action="store_true",
                   help="evict / route a prompt in one step at the end of its forward, not layer by layer "
                        "(CacheOptions.layerwise_prefill=False; the same entries, more memory during the prefill)")
    p.add_argument("--evict-every", type=int, default=None,
                   help="decode steps between eviction steps (default: 16, or the tier window with --tiers)")
    p.add_argument("--steps", type=int, default=32, help="decode steps per repeat")
    p.add_argument("--repeats", type=int, default=3, help="decode repeats (the median is reported)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--plot", default=None, help="write a PNG: tokens/s and peak prefill KV vs context")
    p.add_argument("--in-process", action="store_true",
                   help="run everything in this process (default: each run in a fresh process, so that peak "
                        "memory is not inflated by the heap earlier runs left behind)")
    p.add_argument("--interleave", action="store_true",
                   help="paired timing in this process: each repeat runs every cache of a context once (fresh "
                        "prefill + --steps decode steps) in rotating order; rows give medians over repeats")
    add_tier_args(p)
    p.add_argument("--strategy", default=None, help="strategy JSON for polykv (default: the one shipped for SmolLM2)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("policies", help="list the eviction policies")
    p.set_defaults(func=cmd_policies)

    for module, commands in _PLUGGED_COMMANDS:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:  # keep the command visible; say why it fails when used
            for command in commands:
                add_unavailable(sub, command, module, exc)
            continue
        mod.register(sub)
    return parser


# modules that add their own sub-commands, and the commands each adds
_PLUGGED_COMMANDS = (
    ("vlm_kv.eval.cli", ("eval",)),
    ("vlm_kv.eval.sweep_cli", ("sweep",)),
    ("vlm_kv.train.cli", ("train-gates",)),
    ("vlm_kv.train.vlm_cli", ("train-vlm",)),
    ("vlm_kv.train.calibrate.cli", ("calibrate",)),
)


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
