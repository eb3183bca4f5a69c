"""Sub-commands that plug into ``vlm-kv``: one whose module fails to import stays listed, with the reason."""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

from vlm_kv.config import BudgetError
from vlm_kv.models.smollm2 import ModelFileMissing


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


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen sub-command; the errors a user can fix print as one line (exit 2)."""
    # transformers 5.x renames generate's `past_key_values` to `cache`; we keep the older
    # spelling for compatibility across 5.x and do not want its notice in every tool's output
    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "unavailable", False):  # an unavailable command takes any arguments
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        with torch.inference_mode(False):
            return int(args.func(args) or 0)
    except (BudgetError, ModelFileMissing, FileNotFoundError, ValueError) as err:
        print(f"vlm-kv: error: {err}", file=sys.stderr)
        return 2
