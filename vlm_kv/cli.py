"""``vlm-kv`` command line: demo, fidelity, bench, policies, eval (and the gate tools)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

import torch


def _load(model: str):
    from vlm_kv.smollm2 import load_model

    return load_model(model)


def cmd_fidelity(args: argparse.Namespace) -> int:
    from vlm_kv.budget import Budget
    from vlm_kv.fidelity import fidelity

    budget = Budget.parse(args.budget).as_number()  # refuse a bad budget before loading the model
    model, tok = _load(args.model)
    kwargs = {}
    if args.evict_every is not None:
        kwargs["evict_every"] = args.evict_every
    if getattr(args, "gates", None):
        kwargs["gates"] = args.gates
    (result,) = fidelity(
        model, tok, args.text, args.context, args.continuation, [(args.policy, budget)],
        offset=args.offset, progress=not args.json, **kwargs,
    )
    if args.json:
        print(json.dumps(result.json_fields()))
    else:
        r = result
        print(f"policy {r.policy}  budget {r.budget}  context {r.context}  continuation {r.continuation}")
        print(f"  KL(full||compressed) {r.kl:.4f}   top-1 agreement {r.top1:.3f}")
        print(f"  NLL {r.nll:.4f} (full cache {r.full_nll:.4f})")
        print(f"  KV bytes held {r.kv_bytes:,} / full {r.full_kv_bytes:,}  (max after eviction {r.max_kv_bytes:,})")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from vlm_kv.bench import decode_speed

    model, tok = _load(args.model)
    rows = decode_speed(model, tok, args.text, args.context, args.steps, args.policy, float(args.budget),
                        offset=args.offset, repeats=args.repeats)
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(f"{r['cache']:>24}: {r['ms_per_token']:8.2f} ms/token   KV {r['kv_bytes']:>12,} bytes")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from vlm_kv.demo import run_demo

    return run_demo(policy=args.policy, budget=float(args.budget), max_new_tokens=args.max_new_tokens,
                    gates=getattr(args, "gates", None))


def cmd_policies(args: argparse.Namespace) -> int:
    from vlm_kv.policies import POLICIES

    for name, spec in POLICIES.items():
        print(f"{name:>14}  {spec.description}")
    return 0


def _add_text_args(p: argparse.ArgumentParser, context: int) -> None:
    p.add_argument("--model", default="smollm2", help="'smollm2' (the real SmolLM2-135M-Instruct) or a local model folder")
    p.add_argument("--text", required=True, help="plain UTF-8 text file")
    p.add_argument("--offset", type=int, default=0, help="character offset to start reading the text at")
    p.add_argument("--context", type=int, default=context, help="tokens prefilled with the policy")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlm-kv", description="Compressed KV caches for VLMs and LLMs")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="SmolLM2 answers a question about a long text, full vs compressed cache")
    p.add_argument("--policy", default="dbtrimkv", help="default: the learned gates shipped for SmolLM2")
    p.add_argument("--budget", default="0.25")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--gates", default=None, help="gate folder for trimkv/dbtrimkv (default: gates shipped for SmolLM2)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("fidelity", help="KL / top-1 / NLL of a compressed cache vs the full cache on real text")
    _add_text_args(p, 2048)
    p.add_argument("--continuation", type=int, required=True, help="tokens fed one at a time after the prefill")
    p.add_argument("--policy", required=True)
    p.add_argument("--budget", required=True, help="fraction of the full cache in (0, 1], or an int: tokens per KV head")
    p.add_argument("--evict-every", type=int, default=None, help="decode steps between eviction steps (default 16)")
    p.add_argument("--gates", default=None, help="gate folder for trimkv/dbtrimkv (default: gates shipped for SmolLM2)")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.set_defaults(func=cmd_fidelity)

    p = sub.add_parser("bench", help="decode time per token: compressed cache vs DynamicCache")
    _add_text_args(p, 4096)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--policy", default="snapkv")
    p.add_argument("--budget", default="0.1")
    p.add_argument("--json", action="store_true")
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
)


def add_unavailable(subparsers, command: str, module: str, error: BaseException) -> argparse.ArgumentParser:
    """A sub-command whose module failed to import: listed in --help with the error, and
    running it prints the error (exit 2) instead of argparse's 'invalid choice'."""
    reason = f"{type(error).__name__}: {error}"
    p = subparsers.add_parser(command, help=f"(unavailable: {module} failed to import: {reason})",
                              add_help=False)

    def unavailable(args: argparse.Namespace) -> int:
        print(f"vlm-kv {command}: unavailable, importing {module} failed: {reason}", file=sys.stderr)
        return 2

    p.set_defaults(func=unavailable, unavailable=True)
    return p


def main(argv: list[str] | None = None) -> int:
    import warnings

    # transformers 5.x renames generate's `past_key_values` to `cache`; we keep the older
    # spelling for compatibility across 5.x and do not want its notice in every tool's output
    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "unavailable", False):  # an unavailable command takes any arguments
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from vlm_kv.budget import BudgetError
    from vlm_kv.smollm2 import ModelFileMissing

    try:
        with torch.inference_mode(False):
            return int(args.func(args) or 0)
    except (BudgetError, ModelFileMissing, FileNotFoundError, ValueError) as err:
        print(f"vlm-kv: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
