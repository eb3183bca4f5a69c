"""Does smollava look at the image a question asks about? Layer by layer, from the question.

For held-out 8-image contexts (teacher-forced, one forward each), the attention of the token
that predicts the answer's first token, summed over each image's 196 tokens: per layer, the share
of the image attention (mean over heads) that falls on the asked image, the same for the head
that looks at it most, and how often the most-attended image is the asked one. Also whether the
first answer token is the argmax there (a teacher-forced proxy of the answer being right).

    python scripts/smollava_image_attention.py [--weights DIR] --items 16 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from vlm_kv.eval.visual_qa import IGNORE, conversation_pieces, encode_pieces
from vlm_kv.eval.visual_tasks import make_item
from vlm_kv.models.smollava import IMAGE_TOKEN_ID, IMAGE_TOKENS, load_smollava, pixel_values
from vlm_kv.train.image_attention import SegmentAttention, image_targets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default=None, help="smollava folder (default: the shipped weights)")
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--n-images", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.time()
    model, processor = load_smollava(dtype=torch.bfloat16, weights=args.weights)
    tok = processor.tokenizer
    lm = model.model.language_model
    layers = list(range(len(lm.layers)))
    probe = SegmentAttention(lm, layers)
    share = {i: [] for i in layers}
    head_share = {i: [] for i in layers}
    top_right = {i: [] for i in layers}
    first_token_right = []
    kinds = []
    for n in range(args.items):
        item = make_item("multi_image", args.seed, n, n_images=args.n_images)
        ids, labels = encode_pieces(tok, conversation_pieces(item, [q.answer for q in item.questions]))
        input_ids, labels_t = torch.tensor(ids), torch.tensor(labels)
        targets = image_targets(input_ids, labels_t, [q.image_index for q in item.questions], IMAGE_TOKEN_ID,
                                IMAGE_TOKENS, IGNORE)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=input_ids[None], pixel_values=pixel_values(item.images))
            for i in layers:
                m = probe.mass(i, 0, targets)  # [Q, H, S]
                frac = m / m.sum(-1, keepdim=True).clamp_min(1e-12)
                asked = targets.segments
                per_head = frac[torch.arange(len(asked)), :, asked]  # [Q, H]
                share[i] += frac.mean(1)[torch.arange(len(asked)), asked].tolist()
                head_share[i] += per_head.max(-1).values.tolist()
                top_right[i] += (m.mean(1).argmax(-1) == asked).tolist()
        kinds += [q.kind for q in item.questions]
        pred = out.logits[0, targets.positions].argmax(-1)
        first_token_right += (pred == input_ids[targets.positions + 1]).tolist()
        print(f"item {n}: first answer token {'right' if first_token_right[-1] else 'wrong'}", flush=True)
    probe.close()
    rows = {i: {"asked_share": round(sum(share[i]) / len(share[i]), 3),
                "best_head_share": round(sum(head_share[i]) / len(head_share[i]), 3),
                "asked_is_top": round(sum(top_right[i]) / len(top_right[i]), 3)} for i in layers}
    for i in layers:
        print(f"layer {i:2d}: asked image's share {rows[i]['asked_share']:.2f}  best head {rows[i]['best_head_share']:.2f}"
              f"  asked image most attended {rows[i]['asked_is_top']:.2f}")
    late = [i for i in layers if 20 <= i <= 24]  # where the shipped model's questions find the image
    by_kind = {}
    for kind in sorted(set(kinds)):
        mine = [j for j, k in enumerate(kinds) if k == kind]
        by_kind[kind] = {"questions": len(mine),
                         "first_token_right": sum(first_token_right[j] for j in mine),
                         "asked_share_layers_20_24": round(sum(share[i][j] for i in late for j in mine)
                                                           / (len(late) * len(mine)), 3)}
        print(f"{kind}: {by_kind[kind]}")
    chance = 1 / args.n_images
    print(f"first answer token right: {sum(first_token_right)} of {len(first_token_right)}; chance share {chance:.3f}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"weights": args.weights or "shipped", "items": args.items, "seed": args.seed,
                       "n_images": args.n_images, "first_token_right": first_token_right, "kinds": kinds, "by_kind": by_kind,
                       "layers": rows,
                       "seconds": round(time.time() - t0, 1)}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
