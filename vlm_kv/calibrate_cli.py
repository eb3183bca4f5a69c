"""``vlm-kv calibrate``: write a PolyKV strategy for a model from a few text files.

    vlm-kv calibrate --model smollm2 --data pg1342.txt --budget 0.1 \\
        --candidates snapkv,h2o,tova,streaming_llm,adakv --out strategy.json [--phases prefill,decode] \
        [--baseline adakv --margin 0.02 --sensitivity 0.5,2]

Measurements go to ``<out>.progress.json`` as they finish; rerunning the same command resumes.
The strategy plot is written beside it (``<out without .json>.png``) unless ``--no-plot``.
"""

from __future__ import annotations

import argparse
import os

__all__ = ["register", "cmd_calibrate"]


def _list(text: str, kind=str) -> list:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return [kind(t) for t in items]


def cmd_calibrate(args: argparse.Namespace) -> int:
    from vlm_kv.calibrate import CalibrationConfig, calibrate, plot_strategy
    from vlm_kv.cli import _check_model, _check_text, _load

    config = CalibrationConfig(
        budget=float(args.budget), candidates=_list(args.candidates), phases=_list(args.phases),
        context=args.context, continuation=args.continuation, windows_per_file=args.windows,
        sensitivity=_list(args.sensitivity, float), floor_ratio=args.floor_ratio,
        evict_every=args.evict_every, seed=args.seed, baseline=args.baseline or None, margin=args.margin,
        entropy_queries=args.entropy_queries, budget_pattern=args.budget_pattern, budget_source=args.budget_source,
    ).check()
    data = _list(args.data)
    for path in data:
        _check_text(path)
    _check_model(args.model)
    if not args.out.endswith(".json"):
        raise ValueError(f"--out must name a .json file, got {args.out}")
    model, tok = _load(args.model)
    progress = args.progress or args.out[: -len(".json")] + ".progress.json"
    if args.only_measured and not os.path.isfile(progress):
        raise FileNotFoundError(f"--only-measured needs the progress file {progress}")
    strategy = calibrate(model, tok, data, config, progress_path=progress, show_progress=True,
                         only_measured=args.only_measured, gates=args.gates)
    strategy.save(args.out)
    print(f"strategy: {args.out} (measurements: {progress})")
    if not args.no_plot:
        png = args.out[: -len(".json")] + ".png"
        plot_strategy(strategy, png)
        print(f"plot: {png}")
    L = strategy.num_layers
    for phase, entries in strategy.layers.items():
        print(f"{phase}: " + "  ".join(f"{i}:{e.pattern}@{e.budget * L:.3f}" for i, e in enumerate(entries)))
    return 0


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="calibrate a per-layer PolyKV strategy (pattern and budget per layer)")
    p.add_argument("--model", default="smollm2", help="'smollm2' or a local model folder")
    p.add_argument("--data", required=True, help="comma-separated UTF-8 text files")
    p.add_argument("--budget", required=True, help="global budget the strategy is for, a fraction in (0, 1)")
    p.add_argument("--candidates", default="snapkv,h2o,tova,streaming_llm,adakv", help="comma-separated patterns")
    p.add_argument("--phases", default="prefill", help="'prefill' (one pattern for both phases) or 'prefill,decode'")
    p.add_argument("--out", required=True, help="strategy JSON to write")
    p.add_argument("--context", type=int, default=512, help="tokens prefilled per calibration window")
    p.add_argument("--continuation", type=int, default=32, help="tokens fed one at a time after the prefill")
    p.add_argument("--windows", type=int, default=1, help="windows per data file (seeded offsets)")
    p.add_argument("--sensitivity", default="0.5", help="budget multiples probed for sensitivity (below/above 1)")
    p.add_argument("--baseline", default=None,
                   help="pattern (one of the candidates) compressing the other layers of every probe to the "
                        "global budget (leave-one-out against a compressed baseline); default: others full")
    p.add_argument("--margin", type=float, default=0.0,
                   help="relative KL gain a candidate needs to replace the baseline pattern in a layer")
    p.add_argument("--budget-pattern", choices=("chosen", "baseline"), default="chosen",
                   help="pattern a layer's sensitivity is probed with: its chosen one, or the baseline (then the "
                        "budget probes run first and do not wait for the pattern choice)")
    p.add_argument("--budget-source", choices=("probes", "gates"), default="probes",
                   help="layer shares from the probes' sensitivity slopes, or from the entries the model's DBTrimKV "
                        "retention gates keep per layer at the global budget (--gates; default: shipped)")
    p.add_argument("--entropy-queries", type=int, default=64, help="prefill queries the attention entropy averages")
    p.add_argument("--floor-ratio", type=float, default=0.5, help="share of the budget spread evenly over layers")
    p.add_argument("--evict-every", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--gates", default=None, help="gate folder for gated candidates (default: the gates shipped for the model)")
    p.add_argument("--progress", default=None, help="measurements file (default: <out>.progress.json)")
    p.add_argument("--only-measured", action="store_true",
                   help="choose from the measurements already in the progress file (other --margin, --floor-ratio, "
                        "--candidates subset, ...) and measure nothing; fails if one is missing")
    p.set_defaults(func=cmd_calibrate)
