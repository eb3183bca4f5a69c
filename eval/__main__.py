"""``python -m vlm_kv.eval BENCHMARK ...``: the ``vlm-kv eval`` sub-commands, as a module that
distributed launchers can start (``accelerate launch -m vlm_kv.eval mathvision ...``)."""

import sys

from vlm_kv.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", *sys.argv[1:]]))
