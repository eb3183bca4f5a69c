"""``vlm-kv train-vlm``: train smollava's vision tower (flags generated from ``VLMTrainConfig``).

    vlm-kv train-vlm --out runs/smollava            # both stages; rerun the same command to resume
    vlm-kv train-vlm --out runs/smollava --stop-at 200
"""

from __future__ import annotations

import argparse
import json

from vlm_kv.arguments.dataclass_flags import add_dataclass_args, dataclass_from_args
from vlm_kv.train.vlm_train import VLMTrainConfig, export_checkpoint, train_vlm


def cmd_train_vlm(args: argparse.Namespace) -> int:
    cfg = dataclass_from_args(VLMTrainConfig, args)
    cfg.validate()  # every setting checked before SmolLM2 loads
    if cfg.export:
        print(export_checkpoint(cfg.out, cfg.export))
        return 0
    print(json.dumps(train_vlm(cfg)))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("train-vlm", help="train the smollava vision tower and projector (SmolLM2 frozen)")
    add_dataclass_args(p, VLMTrainConfig)
    p.set_defaults(func=cmd_train_vlm)
