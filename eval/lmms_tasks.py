"""Local lmms-eval tasks (no hub access): MathVision from a local jsonl, and smollava's generated
visual questions (``write_visual_task``: held-out items of ``vlm_kv.eval.visual_tasks`` written as
PNG + jsonl, scored by exact match as the multimodal benchmark scores them)::

    python -m vlm_kv.eval.lmms_tasks --visual --data-seed 1 --items 50 --out lmms_tasks/
    python -m lmms_eval --model vlm_kv --model_args pretrained=smollava,policy=dbtrimkv,budget=0.1 \
        --tasks vlm_kv_smollava_single --include_path lmms_tasks/ --output_path logs/

MathVision:

lmms-eval's own ``mathvision_testmini`` task downloads the data set from the hub; this writes a
task folder for ``--include_path`` that reads a local ``testmini.jsonl`` (+ ``images/``) with
the ``json`` builder of ``datasets`` and scores with the authors' rules
(``vlm_kv.eval.mathvision_score``)::

    python -m vlm_kv.eval.lmms_tasks --data ../shared/data/mathvision --out lmms_tasks/
    python -m lmms_eval --model vlm_kv --model_args pretrained=DIR,policy=snapkv,budget=0.25 \\
        --tasks vlm_kv_mathvision_testmini --include_path lmms_tasks/ --limit 8 --output_path logs/

Prompt: the authors' chain-of-thought prompt (``--prompt lmms-eval`` for lmms-eval's variant),
the same text ``vlm-kv eval mathvision`` builds; the image goes in as the visual. Metric
``accuracy``: the fraction of responses judged correct.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from PIL import Image

from vlm_kv.eval.mathvision_prompt import PROMPT_STYLES, build_prompt
from vlm_kv.eval.mathvision_score import score_item
from vlm_kv.eval.visual_tasks import IMAGE_MARK, answer_matches, make_item

__all__ = ["TASK_NAME", "VISUAL_TASK_NAME", "write_mathvision_task", "write_visual_task", "doc_to_visual",
           "doc_to_text", "process_results", "visual_process_results"]

TASK_NAME = "vlm_kv_mathvision_testmini"
VISUAL_TASK_NAME = "vlm_kv_smollava_single"

_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    {split}: {data_file}
test_split: {split}
output_type: generate_until
doc_to_visual: !function {utils}.doc_to_visual
doc_to_text: !function {utils}.doc_to_text
doc_to_target: answer
generation_kwargs:
  max_new_tokens: {max_new_tokens}
  do_sample: false
process_results: !function {utils}.process_results
metric_list:
  - metric: accuracy
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

_UTILS = '''"""Written by vlm_kv.eval.lmms_tasks: binds the shared helpers to this data folder."""
from functools import partial

from vlm_kv.eval import lmms_tasks

IMAGE_ROOT = {image_root!r}
PROMPT = {prompt!r}

doc_to_visual = partial(lmms_tasks.doc_to_visual, image_root=IMAGE_ROOT)
doc_to_text = partial(lmms_tasks.doc_to_text, prompt=PROMPT)
process_results = lmms_tasks.process_results
'''


def doc_to_visual(doc: dict, image_root: str) -> list:
    """The problem's image (RGB), from ``image_root`` / the row's relative ``image`` path."""

    path = doc.get("image")
    if not path:
        raise ValueError(f"MathVision row {doc.get('id')!r} has no image path")
    full = path if os.path.isabs(path) else os.path.join(image_root, path)
    with Image.open(full) as im:
        return [im.convert("RGB")]


def doc_to_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None, prompt: str = "authors") -> str:
    return build_prompt(doc, prompt)


def process_results(doc: dict, results: list) -> dict[str, Any]:
    response = results[0] if results else ""
    _, correct = score_item(str(response), str(doc["answer"]), list(doc.get("options") or []))
    return {"accuracy": float(correct)}


def visual_doc_to_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None) -> str:
    # the image, then the question on its own line: the prompt smollava trained on
    return f"{IMAGE_MARK}\n{doc['question']}"


def visual_process_results(doc: dict, results: list) -> dict[str, Any]:
    response = results[0] if results else ""
    return {"accuracy": float(answer_matches(str(response), str(doc["answer"])))}


_VISUAL_UTILS = '''"""Written by vlm_kv.eval.lmms_tasks: smollava's generated questions in this folder."""
from functools import partial

from vlm_kv.eval import lmms_tasks

doc_to_visual = partial(lmms_tasks.doc_to_visual, image_root={image_root!r})
doc_to_text = lmms_tasks.visual_doc_to_text
process_results = lmms_tasks.visual_process_results
'''


def _write_task(out: Path, task: str, split: str, data_file: Path, utils_source: str, max_new_tokens: int) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    utils = f"{task}_utils"
    (out / f"{utils}.py").write_text(utils_source, encoding="utf-8")
    (out / f"{task}.yaml").write_text(
        _YAML.format(task=task, split=split, data_file=json.dumps(str(data_file)), utils=utils,
                     max_new_tokens=int(max_new_tokens)),
        encoding="utf-8",
    )
    return out


def write_visual_task(out_dir: str | os.PathLike, data_seed: int, items: int, *, images: str = "real",
                      max_new_tokens: int = 8, task: str = VISUAL_TASK_NAME) -> Path:
    """Write ``items`` single-image items of ``data_seed`` (PNG + ``<task>.jsonl``), the task yaml and
    its utils module into ``out_dir``; returns the folder for lmms-eval's ``--include_path``.
    smollava trained on seed 0: any other seed is held out."""
    if items < 1:
        raise ValueError(f"items must be >= 1, got {items}")
    out = Path(out_dir).resolve()
    (out / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(items):
        item = make_item("single", data_seed, i, images=images)
        name = f"images/{task}_{data_seed}_{i}.png"
        item.images[0].save(out / name)
        for k, q in enumerate(item.questions):
            rows.append({"id": f"{data_seed}-{i}-{k}", "image": name, "question": q.text, "answer": q.answer,
                         "kind": q.kind})
    data_file = out / f"{task}.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return _write_task(out, task, "test", data_file, _VISUAL_UTILS.format(image_root=str(out)), max_new_tokens)


def write_mathvision_task(out_dir: str | os.PathLike, data: str | os.PathLike, *, split: str = "testmini",
                          prompt: str = "authors", max_new_tokens: int = 4096, task: str = TASK_NAME) -> Path:
    """Write ``<task>.yaml`` and its utils module into ``out_dir``; returns the folder for
    lmms-eval's ``--include_path``. ``data``: a folder holding ``<split>.jsonl`` and ``images/``,
    or the jsonl itself (images resolved against its folder)."""

    if prompt not in PROMPT_STYLES:
        raise ValueError(f"unknown prompt style {prompt!r}; choose one of {', '.join(PROMPT_STYLES)}")
    data = Path(data).resolve()
    data_file = data / f"{split}.jsonl" if data.is_dir() else data
    if not data_file.is_file():
        raise FileNotFoundError(f"MathVision data not found: {data_file}")
    return _write_task(Path(out_dir), task, split, data_file,
                       _UTILS.format(image_root=str(data_file.parent), prompt=prompt), max_new_tokens)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vlm_kv.eval.lmms_tasks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="MathVision: folder with <split>.jsonl + images/, or the jsonl")
    p.add_argument("--visual", action="store_true", help="write smollava's generated single-image task instead")
    p.add_argument("--data-seed", type=int, default=1, help="--visual: generator seed (held out: not 0)")
    p.add_argument("--items", type=int, default=50, help="--visual: items (images) to write")
    p.add_argument("--out", required=True, help="task folder to write (lmms-eval --include_path)")
    p.add_argument("--split", default="testmini")
    p.add_argument("--prompt", default="authors", choices=("authors", "lmms-eval"))
    p.add_argument("--max-new-tokens", type=int, default=4096)
    args = p.parse_args(argv)
    if args.visual:
        out = write_visual_task(args.out, args.data_seed, args.items)
        print(f"--include_path {out} --tasks {VISUAL_TASK_NAME}")
        return 0
    if args.data is None:
        p.error("--data is required (or --visual)")
    out = write_mathvision_task(args.out, args.data, split=args.split, prompt=args.prompt,
                                max_new_tokens=args.max_new_tokens)
    print(f"--include_path {out} --tasks {TASK_NAME}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
