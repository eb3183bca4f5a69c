"""``vlm-kv calibrate``: write a PolyKV strategy for a model from a few text files.

    vlm-kv calibrate --model smollm2 --data pg1342.txt --budget 0.1 \\
        --candidates snapkv,h2o,tova,streaming_llm,adakv --out strategy.json [--phases prefill,decode] \
        [--baseline adakv --margin 0.02 --sensitivity 0.5,2]

On image data (a vision-language model; MathVision-style JSONL or conversation JSONL, as
``train-gates`` reads, whose image paths are relative to ``--images``), each window is one problem
or one chat up to its first answer, and every layer also gets modality shares:

    vlm-kv calibrate --model /models/Qwen2.5-VL-7B-Instruct --data testmini.jsonl \
        --images /work/shared/data/mathvision --budget 0.1 --candidates snapkv,tova,adakv \
        --windows 8 --continuation 16 --max-pixels 200704 --out strategy.json

smollava on its own multi-image chats (training seed 0, as its gates were trained):

    python -m vlm_kv.eval.visual_export --task multi_image --seed 0 --items 8 --out data/smollava_chats
    vlm-kv calibrate --model smollava --data data/smollava_chats/data.jsonl --images data/smollava_chats \
        --budget 0.1 --candidates snapkv,tova,adakv --windows 4 --continuation 8 --out strategy.json

Measurements go to ``<out>.progress.json`` as they finish; rerunning the same command resumes.
The strategy plot is written beside it (``<out without .json>.png``) unless ``--no-plot``.
"""

from __future__ import annotations

import argparse
import os

from vlm_kv.arguments.checks import check_text_file
from vlm_kv.models.named import check_model, is_vlm, load_model, load_vlm
from vlm_kv.train.calibrate.calibrate import CalibrationConfig, calibrate, plot_strategy
from vlm_kv.train.calibrate.data import check_image_data

__all__ = ["register", "cmd_calibrate"]


def _list(text: str, kind=str) -> list:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return [kind(t) for t in items]


def cmd_calibrate(args: argparse.Namespace) -> int:
    config = CalibrationConfig(
        budget=float(args.budget), candidates=_list(args.candidates), phases=_list(args.phases),
        context=args.context, continuation=args.continuation, windows_per_file=args.windows,
        sensitivity=_list(args.sensitivity, float), floor_ratio=args.floor_ratio,
        evict_every=args.evict_every, seed=args.seed, baseline=args.baseline or None, margin=args.margin,
        entropy_queries=args.entropy_queries, budget_pattern=args.budget_pattern, budget_source=args.budget_source,
        modality_factor=args.modality_factor, modality_floor=args.modality_floor, min_pixels=args.min_pixels,
        max_pixels=args.max_pixels, prompt_style=args.prompt_style,
    ).check()
    data = _list(args.data)
    if args.images is not None:
        if not is_vlm(args.model):
            raise ValueError(f"--images needs a vision-language model (smollava, or a folder whose config.json has a "
                             f"vision_config); "
                             f"{args.model} is a text-only model")
        check_image_data(data, args.images, args.windows)
    else:
        vlm_only = [f"--{n.replace('_', '-')}" for n in ("min_pixels", "max_pixels") if getattr(args, n) is not None]
        if vlm_only:
            raise ValueError(f"{', '.join(vlm_only)} apply to image data: give --images DIR")
        for path in data:
            if path.endswith(".jsonl"):
                raise ValueError(f"{path} looks like image data (.jsonl): give --images DIR (the folder its "
                                 "image paths are relative to), or pass a plain text file")
            check_text_file(path)
    check_model(args.model)
    if not args.out.endswith(".json"):
        raise ValueError(f"--out must name a .json file, got {args.out}")
    if args.images is not None:
        model, tok = load_vlm(args.model, device="cpu", dtype="float32")  # tok: the processor
    else:
        model, tok = load_model(args.model)  # text data: loaded as before
    progress = args.progress or args.out[: -len(".json")] + ".progress.json"
    if args.only_measured and not os.path.isfile(progress):
        raise FileNotFoundError(f"--only-measured needs the progress file {progress}")
    strategy = calibrate(model, tok, data, config, progress_path=progress, show_progress=True,
                         only_measured=args.only_measured, gates=args.gates, images=args.images)
    strategy.save(args.out)
    print(f"strategy: {args.out} (measurements: {progress})")
    if not args.no_plot:
        png = args.out[: -len(".json")] + ".png"
        plot_strategy(strategy, png)
        print(f"plot: {png}")
    L = strategy.num_layers
    for phase, entries in strategy.layers.items():
        print(f"{phase}: " + "  ".join(f"{i}:{e.pattern}@{e.budget * L:.3f}" for i, e in enumerate(entries)))
    if any(e.modality for e in strategy.phase("prefill")):
        print("modality shares: " + "  ".join(
            f"{i}:" + "/".join(f"{m}={v:.2f}" for m, v in e.modality.items())
            for i, e in enumerate(strategy.phase("prefill"))))
    return 0


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="calibrate a per-layer PolyKV strategy (pattern and budget per layer)")
    p.add_argument("--model", default="smollm2", help="'smollm2' or a local model folder")
    p.add_argument("--data", required=True,
                   help="comma-separated UTF-8 text files, or with --images .jsonl files of MathVision-style "
                        "problems or of conversations (messages / LLaVA style, as train-gates reads)")
    p.add_argument("--images", default=None,
                   help="image data: the folder the JSONL rows' image paths are relative to (a vision-language "
                        "model folder only); one window per problem, and every layer also gets modality shares")
    p.add_argument("--min-pixels", type=int, default=None, help="image data: least pixels per image (Qwen VL)")
    p.add_argument("--max-pixels", type=int, default=None,
                   help="image data: most pixels per image (Qwen VL; default: the processor's)")
    p.add_argument("--prompt-style", choices=("authors", "lmms-eval"), default="authors",
                   help="image data: MathVision prompt style (as `vlm-kv eval mathvision`)")
    p.add_argument("--modality-factor", type=float, default=0.5,
                   help="image data: a modality probe multiplies that modality's share of the layer by this")
    p.add_argument("--modality-floor", type=float, default=0.05,
                   help="image data: least share of a layer's budget every modality present gets")
    p.add_argument("--budget", required=True, help="global budget the strategy is for, a fraction in (0, 1)")
    p.add_argument("--candidates", default="snapkv,h2o,tova,streaming_llm,adakv", help="comma-separated patterns")
    p.add_argument("--phases", default="prefill", help="'prefill' (one pattern for both phases) or 'prefill,decode'")
    p.add_argument("--out", required=True, help="strategy JSON to write")
    p.add_argument("--context", type=int, default=512,
                   help="tokens prefilled per calibration window (text data; image data prefill each whole prompt)")
    p.add_argument("--continuation", type=int, default=32,
                   help="tokens fed one at a time after the prefill (image data: the full cache's greedy ones)")
    p.add_argument("--windows", type=int, default=1,
                   help="windows per data file (seeded offsets; image data: problems drawn per file)")
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
