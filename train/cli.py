"""``vlm-kv train-gates``: train retention gates for a frozen model.

    vlm-kv train-gates --model smollm2 --data book.txt --budget-tokens 128 --global \\
        --max-length 512 --steps 200 --out gates/smollm2-g128
    vlm-kv train-gates --model smollm2 --data book.txt --budget-range 0.05,0.3 --global \\
        --max-length 2048 --steps 60 --out runs/smollm2-multi      # one gate set for all budgets
    accelerate launch -m vlm_kv.train.cli train-gates ...        # several GPUs
"""

from __future__ import annotations

import argparse
import json

from vlm_kv.eval.planted_facts import FACT_KINDS
from vlm_kv.train.loop import TrainConfig, train_gates


def _fraction_range(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI fractions such as 0.05,0.3, got {text!r}") from None
    if not 0 < lo <= hi <= 1:
        raise argparse.ArgumentTypeError(f"need 0 < LO <= HI <= 1, got {text!r}")
    return lo, hi


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 or a local model folder")
    p.add_argument("--data", nargs="+", required=True,
                   help="text files, {'text'} JSONL, or conversation JSONL (LLaVA or messages style)")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget-tokens", type=int, help="M: fixed cache budget in tokens per KV head")
    budget.add_argument("--budget-range", type=_fraction_range, metavar="LO,HI",
                        help="multi-budget: per step draw a fraction of the sequence in [LO, HI] "
                             "(log-uniform), e.g. 0.05,0.3; LO,LO trains one fractional budget")
    p.add_argument("--global", dest="global_budget", action="store_true",
                   help="global capacity loss over all layers and heads (DBTrimKV); default per head")
    p.add_argument("--max-length", type=int, default=512, help="tokens per training sequence")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps")
    p.add_argument("--out", required=True, help="output folder (gates, checkpoints, metrics.jsonl)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (reference 2e-4 for long GPU runs)")
    p.add_argument("--min-lr", type=float, default=None, help="cosine floor (default lr/10)")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default min(100, steps/10))")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kind", choices=("dbtrimkv", "trimkv"), default="dbtrimkv")
    p.add_argument("--uncoupled", action="store_true", help="per-layer output projections (coupling ablation)")
    p.add_argument("--width", type=int, default=64, help="gate MLP width")
    p.add_argument("--init-bias", type=float, default=18.0, help="initial output bias (beta ~ 1: keep all)")
    p.add_argument("--lambda-cap", type=float, default=1.0)
    p.add_argument("--weight-decay", type=float, default=1e-6)
    p.add_argument("--init-gates", default=None, help="start from these saved gates (fine-tuning)")
    p.add_argument("--exact-capacity", action="store_true",
                   help="O(T^2) double sum for the capacity term (default: the O(T) scan)")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step (checkpointed); resume later")
    p.add_argument("--facts-share", type=float, default=0.0,
                   help="share of the text samples turned into chats with planted facts (codes, names, dates, "
                        "lists) asked for in later turns: trains the gates to keep what will be asked")
    p.add_argument("--facts-per-sample", type=int, default=3, help="planted facts (and questions) per such chat")
    p.add_argument("--facts-kinds", type=lambda t: tuple(x for x in t.split(",") if x), default=FACT_KINDS,
                   help=f"comma-separated kinds of planted facts, from {','.join(FACT_KINDS)} (default all)")
    p.add_argument("--answer-weight", type=float, default=0.0,
                   help="extra weight of the distillation loss on the planted facts' answer tokens (needs --facts-share)")
    p.add_argument("--teacher-weight", type=float, default=0.0,
                   help="weight of the reconstruction teacher: the gates' ranking held against the entries KVzip "
                        "keeps at the step's budget (train/teacher.py; text samples only; 0 = off)")
    p.add_argument("--teacher-temperature", type=float, default=1.0,
                   help="scale of the teacher's logistic loss, in e-folds of an entry's decay")
    p.add_argument("--teacher-per-layer", action="store_true",
                   help="the teacher's kept set ranked within each layer (KVzip's choice inside a layer; the split "
                        "between layers left to the gates) instead of over all layers")
    p.add_argument("--no-progress", action="store_true")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        model=args.model, data=args.data, budget_tokens=args.budget_tokens, budget_range=args.budget_range,
        global_budget=args.global_budget, weight_decay=args.weight_decay, init_gates=args.init_gates,
        exact_capacity=args.exact_capacity,
        max_length=args.max_length, steps=args.steps, out=args.out, resume=args.resume, lr=args.lr,
        min_lr=args.min_lr, warmup=args.warmup, grad_accum=args.grad_accum, batch_size=args.batch_size,
        save_every=args.save_every, seed=args.seed, kind=args.kind, coupled=not args.uncoupled,
        width=args.width, init_bias=args.init_bias, lambda_cap=args.lambda_cap, stop_at=args.stop_at,
        progress=not args.no_progress, facts_share=args.facts_share, facts_per_sample=args.facts_per_sample,
        facts_kinds=args.facts_kinds, answer_weight=args.answer_weight, teacher_weight=args.teacher_weight,
        teacher_temperature=args.teacher_temperature, teacher_per_layer=args.teacher_per_layer,
    )


def cmd_train_gates(args: argparse.Namespace) -> int:
    result = train_gates(config_from_args(args))
    summary = {k: v for k, v in result.items() if k != "gates"}
    summary["metrics"] = {k: v for k, v in (summary.get("metrics") or {}).items() if k != "live_per_head"}
    print(json.dumps(summary))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("train-gates", help="train retention gates (TrimKV / DBTrimKV) for a frozen model")
    add_arguments(p)
    p.set_defaults(func=cmd_train_gates)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlm_kv.train.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
