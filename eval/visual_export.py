"""Generated visual tasks written as a conversation dataset that ``vlm-kv train-gates`` reads.

    python -m vlm_kv.eval.visual_export --task multi_turn --seed 0 --items 200 --out data/smollava_turns
    vlm-kv train-gates --model smollava --data data/smollava_turns/data.jsonl ../shared/data/text/pg1342.txt \\
        --answer-weight 1 ...

Each item becomes one messages-style JSONL record: the first user turn holds the captioned images
(PNG files under ``images/``, paths relative to the JSONL file) and the first question, then every
question's answer as an assistant turn and the next question as a user turn. Rendered through
smollava's chat template this is token for token the chat the model was trained and is evaluated
on (``visual_qa.conversation_pieces``, tested). With ``--answer-weight`` the assistant turns are the
answers the gate training weighs up: questions about images asked after the images, which a cache
must keep without knowing them (the visual side of the retrieval-aware recipe, issue 26).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm.auto import tqdm

from vlm_kv.eval.visual_tasks import IMAGE_MARK, TASKS, Item, make_item


def item_messages(item: Item, image_paths: list[str]) -> list[dict]:
    """The chat of ``item`` with every answer filled in; images as ``{"type": "image", "image": path}``."""
    if len(image_paths) != len(item.scenes):
        raise ValueError(f"item has {len(item.scenes)} images, got {len(image_paths)} paths")
    parts = item.preamble.split(IMAGE_MARK)
    content: list[dict] = []
    for k, text in enumerate(parts):
        if text:
            content.append({"type": "text", "text": text})
        if k < len(image_paths):
            content.append({"type": "image", "image": image_paths[k]})
    content.append({"type": "text", "text": item.questions[0].text})
    messages = [{"role": "user", "content": content}]
    for k, question in enumerate(item.questions):
        if k:
            messages.append({"role": "user", "content": question.text})
        messages.append({"role": "assistant", "content": question.answer})
    return messages


def export(task: str, seed: int, count: int, out: str | Path, start: int = 0, progress: bool = True,
           **item_kwargs) -> Path:
    """Write ``count`` items of ``task`` under data seed ``seed`` to ``out/data.jsonl`` and
    ``out/images/``; returns the JSONL path. Rerunning rewrites the same files."""
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    path = out / "data.jsonl"
    tmp = path.with_suffix(".jsonl.part")
    with open(tmp, "w", encoding="utf-8") as fh:
        for i in tqdm(range(start, start + count), desc=f"export {task}", disable=not progress):
            item = make_item(task, seed, i, **item_kwargs)
            names = []
            for k, image in enumerate(item.images):
                name = f"images/{task}_{seed}_{i}_{k}.png"
                image.save(out / name)
                names.append(name)
            record = {"messages": item_messages(item, names), "task": task, "seed": seed, "index": i}
            fh.write(json.dumps(record) + "\n")
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="multi_turn", choices=TASKS)
    p.add_argument("--seed", type=int, default=0, help="data seed (0 is smollava's training split)")
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--n-images", type=int, default=None, help="images per multi-image context (default: the task's)")
    p.add_argument("--n-questions", type=int, default=None, help="questions per multi_turn context (default: 4-8)")
    p.add_argument("--out", required=True)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    extra = {"n_images": args.n_images} if args.n_images else {}
    if args.n_questions:
        extra["n_questions"] = args.n_questions
    try:
        print(export(args.task, args.seed, args.items, args.out, start=args.start, progress=not args.no_progress, **extra))
    except ValueError as err:  # a bad combination of counts: say which, no traceback
        raise SystemExit(f"visual_export: {err}") from None


if __name__ == "__main__":
    main()
