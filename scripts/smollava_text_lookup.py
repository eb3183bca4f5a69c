"""Colour vs shape lookups with the images written out as text (issue 22, session 29).

In 8-image contexts smollava answers "What shape is the blue object in image k?" but not "What
colour is the triangle in image k?". The tower writes an object as a colour cell followed by a
shape cell, so one reading is that the second question asks the language model to find a token
and answer with the one *before* it. This checks that reading without pixels: each image is
replaced by its cell texts in reading order (what the tower was trained to put in its visual
tokens; background cells are dropped), and the same held-out questions are asked of a text model
(SmolLM2, or smollava's language model with its adapters merged: ``--model smollava[:FOLDER]``).
If colour questions fail on text too, the asymmetry is the language model's lookup, not the tower.
``--layout shape-first`` writes each object's shape word before its colour word (the tower's order
swapped): if the reading holds, the asymmetry turns around with it.
A question counts as right when the first colour (shape) word of the answer is the asked one; exact
match is recorded too.

    OMP_NUM_THREADS=1 python scripts/smollava_text_lookup.py --model smollm2 --items 48 \
        --out docs/smollava/attn/text_lookup_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from tqdm.auto import tqdm
from vlm_kv.eval.visual_tasks import BLANK, COLOURS, SHAPES, answer_matches, make_item

from vlm_kv.models.named import load_model

VOCABULARY = {"colour": tuple(COLOURS), "shape": SHAPES}


def first_named(generated: str, kind: str) -> str | None:
    """The first colour (or shape) word in ``generated``: a text model answers in a sentence
    ("The triangle in image 3 is orange."), so exact match would score its format, not its lookup."""
    words = re.findall(r"[a-z]+", generated.lower())
    return next((w for w in words if w in VOCABULARY[kind]), None)


LAYOUTS = ("as-taught", "shape-first")


def scene_text(scene, layout: str = "as-taught") -> str:
    """The scene's cell texts in reading order, background cells dropped; ``shape-first`` swaps each
    object's colour and shape cells."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
    rows = [list(row) for row in scene.cell_tokens]
    if layout == "shape-first":
        for obj in scene.objects:
            row = rows[obj.row]
            row[obj.col], row[obj.col + 1] = row[obj.col + 1], row[obj.col]
    return "".join(cell for row in rows for cell in row if cell != BLANK)


def prompt(item, layout: str = "as-taught") -> str:
    parts = [f"Image {k + 1}: {s.caption}.\n{scene_text(s, layout).strip()}\n" for k, s in enumerate(item.scenes)]
    return "".join(parts) + "\n" + item.questions[0].text


@torch.no_grad()
def ask(model, tokenizer, text: str) -> str:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                         pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--items", type=int, default=48)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--n-images", type=int, default=8)
    ap.add_argument("--layout", choices=LAYOUTS, default="as-taught")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model)
    result = {"settings": vars(args), "kinds": {}}
    for kind in ("colour", "shape"):
        rows = []
        for i in tqdm(range(args.items), desc=kind, leave=False):
            item = make_item("multi_image", args.seed, i, n_images=args.n_images, kinds=(kind,))
            q = item.questions[0]
            generated = ask(model, tokenizer, prompt(item, args.layout))
            named = first_named(generated, kind)
            rows.append({"index": i, "image": q.image_index + 1, "answer": q.answer, "generated": generated,
                         "exact": answer_matches(generated, q.answer), "named": named, "correct": named == q.answer})
        right = sum(r["correct"] for r in rows)
        exact = sum(r["exact"] for r in rows)
        result["kinds"][kind] = {"correct": right, "exact": exact, "questions": len(rows), "accuracy": right / len(rows),
                                 "rows": rows}
        print(kind, right, "/", len(rows), "(exact", exact, ")", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
