"""``python -m vlm_kv.eval BENCHMARK ...``: the ``vlm-kv eval`` sub-commands, as a module that
distributed launchers can start (``accelerate launch -m vlm_kv.eval mathvision ...``)."""

import argparse
import sys

from vlm_kv.arguments.subcommands import run_command
from vlm_kv.eval.cli import register


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlm_kv.eval")
    register(parser.add_subparsers(dest="command", required=True))
    return run_command(parser, ["eval", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
