"""A local lmms-eval task over a MathVision jsonl and its images (no hub access).

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

__all__ = ["TASK_NAME", "write_mathvision_task", "doc_to_visual", "doc_to_text", "process_results"]

TASK_NAME = "vlm_kv_mathvision_testmini"

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
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    utils = f"{task}_utils"
    (out / f"{utils}.py").write_text(_UTILS.format(image_root=str(data_file.parent), prompt=prompt), encoding="utf-8")
    (out / f"{task}.yaml").write_text(
        _YAML.format(task=task, split=split, data_file=json.dumps(str(data_file)), utils=utils,
                     max_new_tokens=int(max_new_tokens)),
        encoding="utf-8",
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vlm_kv.eval.lmms_tasks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="folder with <split>.jsonl + images/, or the jsonl")
    p.add_argument("--out", required=True, help="task folder to write (lmms-eval --include_path)")
    p.add_argument("--split", default="testmini")
    p.add_argument("--prompt", default="authors", choices=("authors", "lmms-eval"))
    p.add_argument("--max-new-tokens", type=int, default=4096)
    args = p.parse_args(argv)
    out = write_mathvision_task(args.out, args.data, split=args.split, prompt=args.prompt,
                                max_new_tokens=args.max_new_tokens)
    print(f"--include_path {out} --tasks {TASK_NAME}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
