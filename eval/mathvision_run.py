"""MathVision generation runner on a (compressed) KV cache.

For every problem: build the prompt (:mod:`.mathvision_prompt`), render it
with the processor's chat template, run the processor on text + image, make a
fresh cache with ``vlm_kv.make_cache(model, policy=..., budget=...)`` and call
``model.generate(**inputs, cache=cache, max_new_tokens=..., do_sample=False)``
(greedy, as the reference runs; ``cache=`` is transformers 5.x's name, ``past_key_values=``
before it, see ``vlm_kv.api.cache_kwarg``).  The new tokens are decoded and scored right away
with the authors' rules (:mod:`.mathvision_score`).

Output folder
-------------
``run_config.json``
    policy, budget, prompt style, max_new_tokens, model, data.  Resuming into
    a folder written with other settings is refused.
``mathvision.jsonl``
    one row per problem, appended as soon as the problem finishes: ``id``,
    ``response``, ``extracted``, ``correct``, ``error`` (null when fine),
    plus ``level``, ``subject``, token counts, ``truncated`` and seconds.
    Rerunning skips ids already present (``retry_errors=True`` runs again the
    ones recorded with an error).  A torn last line from a crash is dropped.
``mathvision_result.json``
    the aggregate in the authors' format (``{"-all": "c/n=p%", ...}``) over
    the problems of this run; problems with an error count as incorrect.
``summary.json``
    counts (done, correct, errors by kind) and the settings.

Per-problem failures (unusable row, missing image, processor or generation
error) are written as rows with ``error`` set and counted; they never stop
the run.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from tqdm.auto import tqdm

from vlm_kv import make_cache as _make_cache
from vlm_kv.api import cache_kwarg
from vlm_kv.models.vision_inputs import is_qwen_vl_processor, qwen_vision_info

from .mathvision_data import MathVisionProblem
from .mathvision_prompt import PROMPT_STYLES, build_messages
from .mathvision_score import aggregate, have_latex2sympy, score_item

__all__ = [
    "CONFIG_FILE",
    "RESPONSES_FILE",
    "RESULT_FILE",
    "SUMMARY_FILE",
    "RunSummary",
    "generate_response",
    "load_rows",
    "run_mathvision",
]

CONFIG_FILE = "run_config.json"
RESPONSES_FILE = "mathvision.jsonl"
RESULT_FILE = "mathvision_result.json"
SUMMARY_FILE = "summary.json"

# settings that must match when a run is resumed in the same folder
_RESUME_KEYS = ("policy", "budget", "prompt", "max_new_tokens", "min_pixels", "max_pixels")


@dataclass
class RunSummary:
    out_dir: Path
    result: dict[str, str]
    n_problems: int
    n_generated: int  # generated in this call
    n_skipped: int  # already in the file
    n_correct: int
    n_errors: int
    errors: list[tuple[str, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "n_problems": self.n_problems,
            "n_generated": self.n_generated,
            "n_skipped": self.n_skipped,
            "n_correct": self.n_correct,
            "n_errors": self.n_errors,
            "accuracy": self.result.get("-all"),
        }


# --------------------------------------------------------------------------
# one problem
# --------------------------------------------------------------------------


def _decode(processor: Any, ids) -> str:
    decode = getattr(processor, "batch_decode", None)
    if decode is None:
        decode = processor.tokenizer.batch_decode
    return decode(ids, skip_special_tokens=True)[0]


def model_inputs(model: Any, processor: Any, problem: MathVisionProblem, image: Any, prompt_style: str,
                  min_pixels: int | None = None, max_pixels: int | None = None):
    messages = build_messages(problem, prompt_style)
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if is_qwen_vl_processor(processor):  # sized as qwen-vl-utils does, the processor keeps the size
        messages[0]["content"][0]["image"] = image
        images, _, _ = qwen_vision_info(messages, processor, min_pixels=min_pixels, max_pixels=max_pixels)
        inputs = processor(text=[text], images=images, do_resize=False, return_tensors="pt")
    elif min_pixels is not None or max_pixels is not None:
        raise ValueError(f"min_pixels / max_pixels apply to Qwen VL processors, not {type(processor).__name__}")
    else:
        inputs = processor(text=[text], images=[image], return_tensors="pt")
    device = getattr(model, "device", None)
    dtype = getattr(model, "dtype", None)
    moved = {}
    for key, value in dict(inputs).items():
        if isinstance(value, torch.Tensor):
            if device is not None:
                value = value.to(device)
            if dtype is not None and torch.is_floating_point(value):
                value = value.to(dtype)
        moved[key] = value
    return moved


def generate_response(
    model: Any,
    processor: Any,
    problem: MathVisionProblem,
    *,
    policy: str,
    budget: float | int,
    prompt_style: str = "authors",
    max_new_tokens: int = 4096,
    make_cache: Callable[..., Any] | None = None,
    cache_kwargs: dict[str, Any] | None = None,
    image: Any = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> tuple[str, dict[str, Any]]:
    """Generate one response on a fresh cache: ``(text, info)``.

    ``image``: the problem's PIL image (loaded from the problem when None).
    ``info`` holds ``n_input_tokens``, ``n_new_tokens`` and ``truncated``.
    Raises on any failure (the runner records it).
    """
    if make_cache is None:
        make_cache = _make_cache
    if image is None:
        image = problem.load_image()
    inputs = model_inputs(model, processor, problem, image, prompt_style, min_pixels, max_pixels)
    cache = make_cache(model, policy=policy, budget=budget, **(cache_kwargs or {}))

    out = model.generate(**inputs, **{cache_kwarg(model): cache}, max_new_tokens=max_new_tokens, do_sample=False)
    n_in = int(inputs["input_ids"].shape[1])
    new_ids = out[:, n_in:]
    n_new = int(new_ids.shape[1])
    text = _decode(processor, new_ids)
    info = {"n_input_tokens": n_in, "n_new_tokens": n_new, "truncated": n_new >= max_new_tokens}
    return text, info


# --------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------


def load_rows(path: str | os.PathLike) -> tuple[list[dict[str, Any]], int]:
    """Rows of a responses file and the number of unreadable lines skipped."""
    rows: list[dict[str, Any]] = []
    bad = 0
    p = Path(path)
    if not p.exists():
        return rows, 0
    with open(p, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if isinstance(obj, dict) and obj.get("id") is not None:
                rows.append(obj)
            else:
                bad += 1
    return rows, bad


def _rewrite(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _ends_with_newline(path: Path) -> bool:
    if not path.exists() or path.stat().st_size == 0:
        return True
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def _check_config(out_dir: Path, config: dict[str, Any]) -> None:
    path = out_dir / CONFIG_FILE
    if path.exists():
        old = json.loads(path.read_text(encoding="utf-8"))
        diff = [k for k in _RESUME_KEYS if k in old and old[k] != config.get(k)]
        if diff:
            detail = ", ".join(f"{k}: {old[k]!r} there vs {config.get(k)!r} now" for k in diff)
            raise ValueError(f"{out_dir} holds a MathVision run with other settings ({detail}); use another --out")
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------


def run_mathvision(
    model: Any,
    processor: Any,
    problems: Iterable[MathVisionProblem],
    *,
    policy: str,
    budget: float | int,
    out_dir: str | os.PathLike,
    prompt_style: str = "authors",
    max_new_tokens: int = 4096,
    limit: int | None = None,
    retry_errors: bool = False,
    make_cache: Callable[..., Any] | None = None,
    cache_kwargs: dict[str, Any] | None = None,
    progress: bool = True,
    config_extra: dict[str, Any] | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> RunSummary:
    """Generate, score and aggregate MathVision problems; see the module docstring."""
    if prompt_style not in PROMPT_STYLES:
        raise ValueError(f"unknown prompt style {prompt_style!r}; choose one of {', '.join(PROMPT_STYLES)}")
    selected = list(problems)
    if limit is not None:
        selected = selected[: max(limit, 0)]
    # a repeated id (the loader flags it) is reported, not run: results are keyed by id
    unique: list[MathVisionProblem] = []
    repeated: list[MathVisionProblem] = []
    seen_ids: set[str] = set()
    for p in selected:
        (repeated if p.id in seen_ids else unique).append(p)
        seen_ids.add(p.id)
    selected = unique

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "benchmark": "mathvision",
        "policy": policy,
        "budget": budget,
        "prompt": prompt_style,
        "max_new_tokens": max_new_tokens,
        "do_sample": False,
        "latex2sympy2": have_latex2sympy(),
        **({"min_pixels": min_pixels} if min_pixels is not None else {}),
        **({"max_pixels": max_pixels} if max_pixels is not None else {}),
        **(config_extra or {}),
    }
    _check_config(out, config)

    responses_path = out / RESPONSES_FILE
    rows, bad = load_rows(responses_path)
    if bad:
        print(f"mathvision: dropped {bad} unreadable line(s) from {responses_path} (interrupted write?)",
              file=sys.stderr)
    if bad or not _ends_with_newline(responses_path):
        _rewrite(responses_path, rows)
    latest: dict[str, dict[str, Any]] = {}
    for row in rows:
        latest[str(row["id"])] = row  # a retried id: the last row wins

    todo = [
        p for p in selected
        if p.id not in latest or (retry_errors and latest[p.id].get("error"))
    ]
    n_skipped = len(selected) - len(todo)

    if todo:
        # settings errors (unknown policy, impossible budget) are the run's, not a problem's:
        # fail before writing anything rather than recording the same error for every problem
        factory = make_cache if make_cache is not None else _make_cache
        factory(model, policy=policy, budget=budget, **(cache_kwargs or {}))

    bar = None
    if progress:
        bar = tqdm(total=len(selected), initial=n_skipped, desc=f"mathvision {policy}@{budget}", unit="problem")

    n_generated = 0
    n_new_errors = 0
    with open(responses_path, "a", encoding="utf-8") as fh:
        for problem in todo:
            row = _run_one(model, processor, problem, policy=policy, budget=budget,
                           prompt_style=prompt_style, max_new_tokens=max_new_tokens,
                           make_cache=make_cache, cache_kwargs=cache_kwargs,
                           min_pixels=min_pixels, max_pixels=max_pixels)
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            fh.flush()
            latest[problem.id] = row
            n_generated += 1
            if bar is not None:
                bar.update(1)
                if row.get("error"):
                    n_new_errors += 1
                    bar.set_postfix_str(f"errors: {n_new_errors}")
    if bar is not None:
        bar.close()

    summary = _summarize(out, selected, latest, n_generated, n_skipped, config, repeated)
    return summary


def _run_one(model, processor, problem: MathVisionProblem, **kw) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": problem.id,
        "response": None,
        "extracted": None,
        "correct": False,
        "error": None,
        "error_kind": None,
        "level": problem.level,
        "subject": problem.subject,
        "policy": kw["policy"],
        "budget": kw["budget"],
        "prompt": kw["prompt_style"],
    }
    if problem.error:
        row.update(error=problem.error, error_kind="data")
        return row
    start = time.perf_counter()
    try:
        image = problem.load_image()
    except Exception as exc:  # missing / unreadable image
        row.update(error=f"image: {type(exc).__name__}: {exc}", error_kind="image")
        return row
    try:
        text, info = generate_response(model, processor, problem, image=image, **kw)
    except Exception as exc:  # recorded per problem, never stops the run
        kind = "generation"
        row.update(
            error=f"{type(exc).__name__}: {exc}",
            error_kind=kind,
            traceback=traceback.format_exc(limit=6),
            seconds=round(time.perf_counter() - start, 3),
        )
        free_accelerator_memory()
        return row
    row.update(info)
    row["seconds"] = round(time.perf_counter() - start, 3)
    row["response"] = text
    try:
        row["extracted"], row["correct"] = score_item(text, problem.answer, problem.options)
    except Exception as exc:  # defensive: the scorer itself should not raise
        row.update(error=f"scoring failed: {type(exc).__name__}: {exc}", error_kind="scoring")
    return row


def free_accelerator_memory() -> None:
    """Give cached accelerator memory back between runs (a no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _summarize(out: Path, selected, latest, n_generated, n_skipped, config, repeated=()) -> RunSummary:
    records = []
    errors: list[tuple[str, str]] = [(p.id, p.error or "repeated id") for p in repeated]
    kinds: dict[str, int] = {"repeated_id": len(errors)} if errors else {}
    n_correct = 0
    for p in selected:
        row = latest.get(p.id)
        correct = bool(row and row.get("correct") and not row.get("error"))
        n_correct += correct
        if row is None:
            errors.append((p.id, "no result"))
            kinds["missing"] = kinds.get("missing", 0) + 1
        elif row.get("error"):
            errors.append((p.id, str(row["error"])))
            kind = row.get("error_kind") or "other"
            kinds[kind] = kinds.get(kind, 0) + 1
        # problems whose row could not be read still count, as incorrect
        if p.level is not None and p.subject is not None:
            records.append((p.level, p.subject, correct))
    result = aggregate(records)
    n_unplaced = len(selected) - len(records) + len(repeated)
    (out / RESULT_FILE).write_text(json.dumps(result, indent=4, ensure_ascii=False), encoding="utf-8")
    summary = RunSummary(
        out_dir=out,
        result=result,
        n_problems=len(selected) + len(repeated),
        n_generated=n_generated,
        n_skipped=n_skipped,
        n_correct=n_correct,
        n_errors=len(errors),
        errors=errors,
    )
    payload = {
        **summary.to_json(),
        "errors_by_kind": kinds,
        "not_in_aggregate": n_unplaced,  # malformed problems without level/subject, repeated ids
        "settings": config,
        "result_file": RESULT_FILE,
        "responses_file": RESPONSES_FILE,
    }
    (out / SUMMARY_FILE).write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return summary
