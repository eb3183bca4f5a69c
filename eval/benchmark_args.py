"""Flags every benchmark sub-command shares (image pixel limits, sharding over processes) and the
command line a sharded run relaunches itself with."""

from __future__ import annotations

import argparse
import os


def relaunch_args(args: argparse.Namespace) -> list[str] | None:
    """With ``--num-processes N > 1`` outside a distributed launch: the command line that
    ``python -m vlm_kv.eval`` needs to rerun this sub-command (without --num-processes)."""
    n = getattr(args, "num_processes", None)
    if not n or n <= 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return None
    parser = args.parser
    argv = [args.eval_command]
    for action in parser._actions:
        if action.dest in ("help", "num_processes", "parser", "func") or not action.option_strings:
            continue
        value = getattr(args, action.dest, None)
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                argv.append(action.option_strings[0])
        elif value is not None and value != action.default:
            argv += [action.option_strings[0], str(value)]
    return argv


def add_pixel_limits(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-pixels", type=int, default=None,
                   help="Qwen VL: least pixels per image (qwen-vl-utils' min_pixels, e.g. 200704 = 256*28*28)")
    p.add_argument("--max-pixels", type=int, default=None,
                   help="Qwen VL: most pixels per image (qwen-vl-utils' max_pixels, e.g. 1003520 = 1280*28*28)")


def add_num_processes(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-processes", type=int, default=None,
                   help="shard the problems over N processes (one per GPU, or CPU processes) and merge the "
                   "results into --out, as `accelerate launch --num_processes N -m vlm_kv.eval ...` does")
