"""Can a linear probe read which image a visual token belongs to, layer by layer?

smollava answers questions about "image k" of eight with another image's answer (mostly a
neighbour's, docs/smollava.md). Binding "Image k:" to the 196 tokens after it happens inside the
LM: this script measures, at each layer's residual stream, how well a linear probe trained on
training-split contexts names the image index of each visual token of held-out contexts.

    python scripts/smollava_index_probe.py --weights vlm_kv/models/pretrained/smollava --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from vlm_kv.eval.visual_qa import conversation_pieces, encode_pieces
from vlm_kv.eval.visual_tasks import TRAIN_SEED, make_item
from vlm_kv.models.smollava import IMAGE_TOKEN_ID, IMAGE_TOKENS, load_smollava, pixel_values


def features(model, tokenizer, seed: int, count: int, n_images: int, layers: list[int]):
    """Per layer: [tokens, hidden] of every visual token, and each token's image index (0-based)."""
    feats: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    labels, rows = [], []
    for i in range(count):
        item = make_item("multi_image", seed, i, n_images=n_images)
        ids, _ = encode_pieces(tokenizer, conversation_pieces(item, None, None))
        input_ids = torch.tensor([ids])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=input_ids, pixel_values=pixel_values(item.images), output_hidden_states=True)
        where = (input_ids[0] == IMAGE_TOKEN_ID).nonzero().squeeze(1)
        order = torch.arange(where.numel())
        labels.append(order // IMAGE_TOKENS)
        rows.append((order % IMAGE_TOKENS) // 14)  # the patch row inside its image (14 x 14 patches)
        for layer in layers:
            feats[layer].append(out.hidden_states[layer][0, where].float())
    return {k: torch.cat(v) for k, v in feats.items()}, torch.cat(labels), torch.cat(rows)


def fit_probe(x: torch.Tensor, y: torch.Tensor, classes: int, steps: int = 300):
    """A linear probe on standardised features: (probe, mean, std)."""
    mean, std = x.mean(0), x.std(0) + 1e-5
    probe = torch.nn.Linear(x.shape[1], classes)
    opt = torch.optim.Adam(probe.parameters(), lr=1e-2)
    xs = (x - mean) / std
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(probe(xs), y).backward()
        opt.step()
    return probe, mean, std


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default=None, help="smollava folder (default: the shipped weights)")
    ap.add_argument("--train-items", type=int, default=16)
    ap.add_argument("--test-items", type=int, default=8)
    ap.add_argument("--n-images", type=int, default=8)
    ap.add_argument("--layers", default="0,2,4,6,8,12,16,20,24,30")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    layers = [int(v) for v in args.layers.split(",")]
    t0 = time.time()
    model, processor = load_smollava(dtype=torch.bfloat16, weights=args.weights)
    tok = processor.tokenizer
    xtr, ytr, _ = features(model, tok, TRAIN_SEED, args.train_items, args.n_images, layers)
    xte, yte, rte = features(model, tok, 1, args.test_items, args.n_images, layers)
    result = {"weights": args.weights or "shipped", "n_images": args.n_images, "train_items": args.train_items,
              "test_items": args.test_items, "layers": {}}
    for layer in layers:
        probe, mean, std = fit_probe(xtr[layer], ytr, args.n_images)
        with torch.no_grad():
            pred = probe((xte[layer] - mean) / std).argmax(-1)
        right = pred == yte
        by_row = [round(right[rte == r].float().mean().item(), 3) for r in range(14)]
        off = (pred - yte)[~right]
        result["layers"][layer] = {"accuracy": round(right.float().mean().item(), 3), "by_patch_row": by_row,
                                   "wrong_offsets": {int(k): int((off == k).sum()) for k in off.unique()}}
        print(f"layer {layer:2d}: accuracy {right.float().mean():.3f}  first row {by_row[0]:.2f}  "
              f"last row {by_row[-1]:.2f}", flush=True)
    result["seconds"] = round(time.time() - t0, 1)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
