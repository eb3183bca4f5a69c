"""Per-word accuracy of smollava's visual tokens: the nearest task word of each cell's token.

    python scripts/smollava_patch_accuracy.py --weights runs/smollava/checkpoint.pt --scenes 24

``--weights``: a train-vlm checkpoint (checkpoint.pt) or a folder of trained parts (final/, or the
shipped vlm_kv/models/pretrained/smollava). Scenes come from a stream training never draws
(seed 99999 of the stage-1 scene stream). Prints JSON: accuracy per word, per code character
(all characters together) and for blank cells.
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
import torch.nn.functional as F
from vlm_kv.train import vlm_train as V

from vlm_kv.models.smollava import (
    build_smollava,
    load_checkpoint_or_folder,
    pixel_values,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", required=True)
    p.add_argument("--scenes", type=int, default=24)
    args = p.parse_args()
    model, processor = build_smollava()
    step = load_checkpoint_or_folder(model, args.weights)
    targets = V.PatchTargets(processor.tokenizer, model.get_input_embeddings().weight)
    scenes = V._scenes(99999, args.scenes)
    with torch.no_grad():
        tokens = V.visual_tokens(model, pixel_values([s.image for s in scenes])).float()
    flat = F.normalize(tokens.reshape(-1, tokens.shape[-1]), dim=-1)
    cand = targets.task_ids
    pred = cand[(flat @ F.normalize(targets.embeddings[cand], dim=-1).T).argmax(-1)]
    names = {v: k for k, v in targets.id_of.items()}
    hits = collections.defaultdict(list)
    for p_id, t_id in zip(pred.tolist(), targets.of_scenes(scenes).reshape(-1).tolist()):
        name = names[t_id]
        key = "blank" if name == " " else ("code character" if len(name) == 1 else name.strip())
        hits[key].append(p_id == t_id)
    print(json.dumps({"weights": args.weights, "step": step, "scenes": args.scenes,
                      "accuracy": {k: round(sum(v) / len(v), 4) for k, v in sorted(hits.items())},
                      "cells": {k: len(v) for k, v in sorted(hits.items())}}, indent=1))


if __name__ == "__main__":
    main()
