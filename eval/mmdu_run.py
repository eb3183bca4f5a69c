"""MMDU runner: multi-turn, multi-image generation on ONE cache per dialog, then judging.

Generation protocol (per dialog)
--------------------------------
Turn by turn, the model sees the images and questions so far and its OWN previous answers
(never the references). One cache object (``vlm_kv.make_cache(model, policy, budget)``) lives
for the whole dialog; every turn is prefilled on top of it, so a compressed cache carries all
earlier turns and images. Greedy decoding, ``max_new_tokens`` per answer.

Multi-turn prefix handling (the part that must be exact)
---------------------------------------------------------
``generate`` slices off the first ``cache.get_seq_length()`` tokens of the ``input_ids`` it is
given and prefills the rest, so the given ids must START with exactly the tokens the cache has
seen. Re-rendering the whole conversation with the chat template after each turn does not
guarantee that: the previous answer's text, decoded and re-tokenized, can differ from the ids
that were generated (non-canonical BPE splits, invalid UTF-8 pieces, special tokens dropped by
decoding), and the generated stop token is never fed to the cache. Cropping the cache to the
common prefix is not an option for compressed caches (evicted entries cannot be re-derived).

So the conversation's ids are kept as a token list and only ever appended to:

* turn 1: ``processor.apply_chat_template([user_1], add_generation_prompt=True, tokenize=True,
  return_dict=True, return_tensors="pt")`` exactly as the processor renders it;
* after turn k: + the generated ids (a trailing stop token removed) — the exact ids the cache saw;
* turn k+1: + the template's own text for "end of assistant turn + user turn k+1 + generation
  prompt", obtained by rendering the conversation with the chat template (``tokenize=False``)
  with a sentinel string in place of the last answer and taking everything after the sentinel;
  that segment is tokenized by the processor with the new turn's images (placeholders expanded,
  ``add_special_tokens=False``).

Hence, after turn k the cache has seen ``len(prompt_k) + len(generated_k) - 1`` tokens (the last
sampled token is never fed back), and these are by construction the first tokens of the next
input: ``generate`` prefills the remainder (the last generated token if it was not a stop
token, the template's end-of-turn tokens, the new question and images, the generation prompt).
The runner checks ``cache.get_seq_length()`` against that count before every turn and fails the
run loudly (``CacheStateError``) if a cache breaks the contract. For a well-behaved answer the
ids equal what ``apply_chat_template`` renders for the whole conversation (tested).

Images: ``generate`` slices ``input_ids`` but not pixel values, and it pre-encodes every pixel
value it is given, so passing the pixels of all images on a warm cache fails (features for the
cached images have no placeholder left in the uncached part). The runner therefore passes the
full ``input_ids`` / ``mm_token_type_ids`` / ``image_grid_thw`` (M-RoPE positions are computed
over the whole sequence) and only the NEW images, pre-encoded with the model's own
``get_image_features``, as ``mm_encoder_outputs`` (on the first call of a dialog the pixel
values are passed as usual). Image / video placeholder ids are suppressed during generation (a
real model never emits them; a random one could, and they would desynchronise the next turn).

Results (``out_dir``)
---------------------
* ``run_config.json``: model, data, policy, budget, max_new_tokens (a rerun with other values
  in the same folder is refused).
* ``answers.jsonl``: one line per question, written when its dialog finishes; unrunnable
  questions (data problems) are written too, with ``skipped`` set.
* ``judged.jsonl``: the same lines plus judge text, parsed scores or parse error.
* ``summary.json``: judge, scores (all / valid, x10), parse failures, ROUGE-L mean, policy,
  budget, KV bytes (when the cache exposes ``kv_bytes()``), data problem counts.
Resumable: dialogs whose lines are all present are skipped; partial lines from a crash are
dropped when the file is reopened. Data problems (missing / unreadable images, malformed turns)
are recorded and counted; model or cache errors stop the run (finished dialogs are kept).
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from PIL import Image
from tqdm.auto import tqdm

from vlm_kv import make_cache
from vlm_kv.api import cache_kwarg
from vlm_kv.cache.report import peak_after_eviction
from vlm_kv.eval.mmdu_data import Dialog, MMDUData, split_question
from vlm_kv.eval.mmdu_judge import (
    SCORE_KEYS,
    LocalJudge,
    aggregate,
    build_judge_prompt,
    judge_name,
    mean,
    parse_judge_output,
    rouge_l,
)
from vlm_kv.models.vision_inputs import is_qwen_vl_processor, qwen_vision_info

ANSWERS_FILE = "answers.jsonl"
JUDGED_FILE = "judged.jsonl"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "run_config.json"

_SENTINEL = "\u2063MMDU-ANSWER-SLOT-7f3a\u2063"
_TEXT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
# keys of the generation config that must match for a resumed run
_CONFIG_KEYS = ("model", "data", "policy", "budget", "max_new_tokens", "cache_kwargs", "min_pixels", "max_pixels")


class CacheStateError(RuntimeError):
    """The cache's seen length is not what the conversation's ids say it must be."""


# ----------------------------------------------------------------------------- helpers




def _stop_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if eos is None:
            continue
        ids.update([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _placeholder_ids(model, processor) -> list[int]:
    ids = set()
    for obj, names in (
        (processor, ("image_token_id", "video_token_id")),
        (model.config, ("image_token_id", "video_token_id", "image_token_index", "video_token_index")),
    ):
        for n in names:
            v = getattr(obj, n, None)
            if isinstance(v, int) and v >= 0:
                ids.add(v)
    return sorted(ids)


def _kv_bytes(cache) -> dict[str, Any] | None:
    """The cache's ``kv_bytes()`` after a turn, with ``max_after_eviction``: the most key/value bytes
    it held right after an eviction step so far (``vlm_kv.cache.report.peak_after_eviction``)."""

    fn = getattr(cache, "kv_bytes", None)
    if callable(fn):
        out = fn()
        out = dict(out) if isinstance(out, dict) else {"total": out}
        return {**out, "max_after_eviction": peak_after_eviction(cache)}
    return None


def _model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover
        return torch.device("cpu")


def _load_image(path: str):
    with Image.open(path) as im:
        return im.convert("RGB")


def _user_message(question: str, images: list) -> dict:
    content: list[dict] = []
    for text, k in split_question(question):
        if k is None:
            content.append({"type": "text", "text": text})
        else:
            content.append({"type": "image", "image": images[k]})
    if not content:
        content.append({"type": "text", "text": ""})
    return {"role": "user", "content": content}


def _assistant_message(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def _split_inputs(enc) -> tuple[dict, dict, dict]:
    """(text tensors, pixel tensors, other image tensors) of a processor output."""
    text, pixels, other = {}, {}, {}
    for k, v in dict(enc).items():
        if not isinstance(v, torch.Tensor):
            continue
        if k in _TEXT_KEYS:
            text[k] = v
        elif k.startswith("pixel_values"):
            pixels[k] = v
        else:
            other[k] = v
    return text, pixels, other


def _encode_images(model, pixels: dict, other: dict):
    """The model's own image features for these images (what generate would compute)."""
    base = getattr(model, "model", model)
    fn = getattr(base, "get_image_features", None) or getattr(model, "get_image_features")
    params = inspect.signature(fn).parameters
    kwargs = {k: v for k, v in {**pixels, **other}.items() if k in params}
    kwargs["return_dict"] = True
    with torch.inference_mode():
        return fn(**kwargs)


# ----------------------------------------------------------------------------- one dialog


@dataclass
class TurnOutput:
    answer: str
    answer_ids: list[int]
    n_new_tokens: int
    stopped: bool  # ended on a stop token (False: hit max_new_tokens)
    prompt_tokens: int  # length of the full conversation input for this turn
    cached_before: int  # tokens the cache had seen when the turn started
    kv_bytes: dict | None = None
    seconds: float = 0.0


@dataclass
class DialogState:
    """Token-level record of a conversation: what the model was given and what the cache saw."""

    ids: list[int] = field(default_factory=list)
    mm_types: list[int] | None = None
    image_meta: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # e.g. image_grid_thw rows
    n_images: int = 0
    expected_seen: int = 0


class DialogRunner:
    """Runs the turns of one dialog on one cache (see the module docstring).

    Decoding is greedy (``do_sample=False``); everything else comes from the model's own
    generation config (e.g. a repetition penalty shipped with the checkpoint), as in the MMDU
    authors' scripts, which call each model's own chat function.
    """

    def __init__(self, model, processor, cache, *, max_new_tokens: int = 2048, min_pixels: int | None = None,
                 max_pixels: int | None = None):
        # Qwen VL: images sized as qwen-vl-utils does (min/max pixels), the processor keeps the size
        self.qwen_sizing = is_qwen_vl_processor(processor)
        if not self.qwen_sizing and (min_pixels is not None or max_pixels is not None):
            raise ValueError(f"min_pixels / max_pixels apply to Qwen VL processors, not {type(processor).__name__}")
        self.pixel_limits = {"min_pixels": min_pixels, "max_pixels": max_pixels}
        self.model = model
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.cache = cache
        self.max_new_tokens = int(max_new_tokens)
        self.state = DialogState()
        self.messages: list[dict] = []
        self.stop_ids = _stop_ids(model, self.tokenizer)
        self.suppress = _placeholder_ids(model, processor)
        self.cache_kw = cache_kwarg(model)
        self.device = _model_device(model)

    # -- segment rendering ------------------------------------------------------------------

    def _size_kwargs(self) -> dict:
        return {"do_resize": False} if self.qwen_sizing else {}

    def _sized(self, images: list) -> list:
        if not self.qwen_sizing or not images:
            return images

        msgs = [{"role": "user", "content": [{"type": "image", "image": im} for im in images]}]
        return list(qwen_vision_info(msgs, self.processor, **self.pixel_limits)[0])

    def _render_first(self, user_msg: dict):
        return self.processor.apply_chat_template(
            [user_msg], add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
            **self._size_kwargs(),
        )

    def next_segment_text(self, user_msg: dict) -> str:
        """Template text after the last answer: end of that turn + new user turn + gen prompt."""
        msgs = list(self.messages)
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        msgs[last] = _assistant_message(_SENTINEL)
        text = self.processor.apply_chat_template(msgs + [user_msg], add_generation_prompt=True, tokenize=False)
        if isinstance(text, list):
            text = text[0]
        if text.count(_SENTINEL) != 1:
            raise ValueError("the chat template does not render the assistant's answer verbatim")
        return text.split(_SENTINEL, 1)[1]

    def _render_next(self, user_msg: dict, images: list):
        seg = self.next_segment_text(user_msg)
        kwargs: dict[str, Any] = {"text": [seg], "return_tensors": "pt", "add_special_tokens": False}
        if images:
            kwargs["images"] = images
            kwargs.update(self._size_kwargs())
        return self.processor(**kwargs)

    # -- one turn ---------------------------------------------------------------------------

    def run_turn(self, question: str, images: list) -> TurnOutput:
        t0 = time.perf_counter()
        st = self.state
        images = self._sized(images)
        user_msg = _user_message(question, images)
        first = not self.messages
        enc = self._render_first(user_msg) if first else self._render_next(user_msg, images)
        text, pixels, other = _split_inputs(enc)

        seen = self.cache.get_seq_length() if self.cache is not None else 0
        if seen != st.expected_seen:
            raise CacheStateError(
                f"cache has seen {seen} tokens but the conversation says {st.expected_seen}; "
                "the cache must count every token it was fed (get_seq_length)"
            )

        seg_ids = text["input_ids"][0].tolist()
        st.ids.extend(seg_ids)
        if "mm_token_type_ids" in text:
            if st.mm_types is None:
                st.mm_types = [0] * (len(st.ids) - len(seg_ids))
            st.mm_types.extend(text["mm_token_type_ids"][0].tolist())
        elif st.mm_types is not None:
            st.mm_types.extend([0] * len(seg_ids))
        for k, v in other.items():
            st.image_meta.setdefault(k, []).append(v)
        st.n_images += len(images)

        input_ids = torch.tensor([st.ids], dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            self.cache_kw: self.cache,
            "max_new_tokens": self.max_new_tokens,
            "do_sample": False,
        }
        if st.mm_types is not None:
            kwargs["mm_token_type_ids"] = torch.tensor([st.mm_types], dtype=torch.long, device=self.device)
        for k, parts in st.image_meta.items():
            kwargs[k] = torch.cat(parts, dim=0).to(self.device)
        if pixels:
            if seen == 0:
                kwargs.update({k: v.to(self.device, self.model.dtype) for k, v in pixels.items()})
            else:  # warm cache: only the new images, pre-encoded
                if "mm_encoder_outputs" not in inspect.signature(self.model.forward).parameters:
                    raise NotImplementedError(
                        f"{type(self.model).__name__} takes no mm_encoder_outputs: new images on a warm cache "
                        "cannot be passed to generate (transformers would re-encode all images)"
                    )
                new_other = {k: v.to(self.device) for k, v in other.items()}
                pix = {k: v.to(self.device, self.model.dtype) for k, v in pixels.items()}
                kwargs["mm_encoder_outputs"] = {"image": _encode_images(self.model, pix, new_other)}
        if self.suppress:
            kwargs["suppress_tokens"] = self.suppress
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is not None:
            kwargs["pad_token_id"] = pad

        with torch.inference_mode():
            out = self.model.generate(**kwargs)
        gen = out[0, input_ids.shape[1]:].tolist()
        stopped = bool(gen) and gen[-1] in self.stop_ids
        answer_ids = gen[:-1] if stopped else gen
        # the last sampled token is never fed back: the cache saw everything before it
        st.expected_seen = len(st.ids) + len(gen) - 1 if gen else len(st.ids)
        st.ids.extend(answer_ids)
        if st.mm_types is not None:
            st.mm_types.extend([0] * len(answer_ids))
        answer = self.tokenizer.decode(answer_ids, skip_special_tokens=True).strip()
        self.messages.append(user_msg)
        self.messages.append(_assistant_message(answer))
        return TurnOutput(
            answer=answer,
            answer_ids=answer_ids,
            n_new_tokens=len(gen),
            stopped=stopped,
            prompt_tokens=input_ids.shape[1],
            cached_before=seen,
            kv_bytes=_kv_bytes(self.cache),
            seconds=time.perf_counter() - t0,
        )


def _default_make_cache(model, policy: str, budget, **kwargs):
    return make_cache(model, policy=policy, budget=budget, **kwargs)


def run_dialog(
    model,
    processor,
    dialog: Dialog,
    *,
    policy: str,
    budget,
    max_new_tokens: int = 2048,
    cache_factory: Callable | None = None,
    cache_kwargs: dict | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> list[dict]:
    """All question records of one dialog (answers; unrunnable questions with ``skipped``)."""
    factory = cache_factory or _default_make_cache
    runner: DialogRunner | None = None  # built (with its cache) at the first runnable turn
    records: list[dict] = []
    blocked: str | None = None
    for turn in dialog.turns:
        rec: dict[str, Any] = {
            "dialog_id": dialog.id,
            "turn": turn.index,
            "n_questions": dialog.n_questions,
            "question": turn.question,
            "reference": turn.reference,
            "n_images": len(turn.image_paths),
            "answer": None,
            "skipped": None,
        }
        problem = turn.problem or blocked
        images = []
        if problem is None:
            try:
                images = [_load_image(p) for p in turn.image_paths]
            except Exception as exc:  # noqa: BLE001 - an unreadable file is a data problem
                problem = f"unreadable_image: {type(exc).__name__}: {exc}"
        if problem is not None:
            blocked = blocked or f"after_unrunnable_turn:{turn.index}"
            rec["skipped"] = problem
            records.append(rec)
            continue
        if runner is None:
            cache = factory(model, policy, budget, **(cache_kwargs or {}))
            runner = DialogRunner(model, processor, cache, max_new_tokens=max_new_tokens, min_pixels=min_pixels,
                                  max_pixels=max_pixels)
        out = runner.run_turn(turn.question, images)
        rec.update(
            answer=out.answer,
            n_new_tokens=out.n_new_tokens,
            stopped=out.stopped,
            prompt_tokens=out.prompt_tokens,
            cached_before=out.cached_before,
            seconds=round(out.seconds, 3),
            kv_bytes=out.kv_bytes,
            rouge_l=rouge_l(out.answer, turn.reference),
        )
        records.append(rec)
    return records


# ----------------------------------------------------------------------------- result files


def _read_jsonl(path: Path) -> list[dict]:
    rows: list[dict] = []
    if not path.exists():
        return rows
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash
            if isinstance(row, dict) and "dialog_id" in row and "turn" in row:
                rows.append(row)
    return rows


def load_finished(path: str | os.PathLike) -> dict[str, list[dict]]:
    """Complete dialogs in a result file: dialog id -> its records sorted by turn."""
    by_dialog: dict[str, dict[int, dict]] = {}
    for row in _read_jsonl(Path(path)):
        by_dialog.setdefault(str(row["dialog_id"]), {})[int(row["turn"])] = row
    done: dict[str, list[dict]] = {}
    for did, turns in by_dialog.items():
        n = max(int(r.get("n_questions", 0)) for r in turns.values())
        if n > 0 and sorted(turns) == list(range(n)):
            done[did] = [turns[i] for i in range(n)]
    return done


def _rewrite_compact(path: Path, done: dict[str, list[dict]]) -> None:
    """Keep only complete dialogs (drops partial writes from a crash)."""
    if not path.exists():
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for rows in done.values():
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _append_dialog(path: Path, rows: list[dict]) -> None:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    with open(path, "a", encoding="utf-8") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _check_config(out: Path, config: dict) -> None:
    path = out / CONFIG_FILE
    wanted = {k: config.get(k) for k in _CONFIG_KEYS}
    if path.exists():
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
        old_sel = {k: old.get(k) for k in _CONFIG_KEYS}
        if json.loads(json.dumps(old_sel)) != json.loads(json.dumps(wanted)):
            raise ValueError(
                f"{out} holds results of another run ({old_sel}); this run is {wanted}. "
                "Use another --out folder."
            )
        return
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, default=str)


def _progress(iterable, total: int, desc: str, enabled: bool):
    if not enabled:
        return iterable

    return tqdm(iterable, total=total, desc=desc, unit="dialog")


# ----------------------------------------------------------------------------- phases


def generate_answers(
    model,
    processor,
    data: MMDUData,
    out_dir: str | os.PathLike,
    *,
    policy: str,
    budget,
    max_new_tokens: int = 2048,
    config: dict | None = None,
    cache_factory: Callable | None = None,
    cache_kwargs: dict | None = None,
    progress: bool = True,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> dict[str, int]:
    """Phase 1: answer every dialog not yet in ``answers.jsonl``. Returns run/skip counts."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(config or {})
    cfg.update(policy=policy, budget=budget, max_new_tokens=max_new_tokens, cache_kwargs=cache_kwargs or {})
    if min_pixels is not None or max_pixels is not None:
        cfg.update(min_pixels=min_pixels, max_pixels=max_pixels)
    cfg.setdefault("data", data.path)
    _check_config(out, cfg)
    path = out / ANSWERS_FILE
    done = load_finished(path)
    _rewrite_compact(path, done)
    # dialogs without questions (malformed) have nothing to write; they are in the data problems
    todo = [d for d in data.dialogs if d.id not in done and d.turns]
    counts = {"dialogs_done_before": sum(1 for d in data.dialogs if d.id in done), "dialogs_run": 0}
    for dialog in _progress(todo, len(todo), "MMDU answers", progress):
        rows = run_dialog(
            model,
            processor,
            dialog,
            policy=policy,
            budget=budget,
            max_new_tokens=max_new_tokens,
            cache_factory=cache_factory,
            cache_kwargs=cache_kwargs,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
        )
        _append_dialog(path, rows)
        counts["dialogs_run"] += 1
    return counts


def judge_answers(
    judge: Callable[[str], str],
    out_dir: str | os.PathLike,
    *,
    dialog_ids: list[str] | None = None,
    progress: bool = True,
) -> dict[str, int]:
    """Phase 2: judge every answered dialog not yet in ``judged.jsonl``.

    ``judge``: a callable prompt -> reply text (e.g. :class:`LocalJudge`). A judge exception on
    one question is recorded (``judge_error``) and counted as a parse failure, never fatal.
    """
    out = Path(out_dir)
    answers = load_finished(out / ANSWERS_FILE)
    path = out / JUDGED_FILE
    done = load_finished(path)
    info = judge_name(judge)
    for rows in done.values():
        for r in rows:
            if r.get("judge") is not None and r.get("judge") != info.get("name"):
                raise ValueError(
                    f"{path} was judged by {r.get('judge')!r}, not {info.get('name')!r}; use another --out folder"
                )
    _rewrite_compact(path, done)
    order = dialog_ids if dialog_ids is not None else list(answers)
    todo = [d for d in order if d in answers and d not in done]
    counts = {"dialogs_judged_before": len(done), "dialogs_judged": 0}
    for did in _progress(todo, len(todo), "MMDU judge", progress):
        rows = []
        for rec in answers[did]:
            r = dict(rec)
            r.update(judge=info.get("name"), judge_text=None, scores=None, parse_error=None, judge_error=None)
            if rec.get("skipped") is None and rec.get("answer") is not None:
                prompt = build_judge_prompt(rec["question"], rec.get("reference") or "", rec["answer"])
                try:
                    text = judge(prompt)
                except Exception as exc:  # noqa: BLE001 - reported per question
                    r["judge_error"] = f"{type(exc).__name__}: {exc}"
                    r["parse_error"] = "judge failed"
                else:
                    parsed = parse_judge_output(text)
                    r.update(judge_text=text, scores=parsed.scores, parse_error=parsed.error)
            rows.append(r)
        _append_dialog(path, rows)
        counts["dialogs_judged"] += 1
    return counts


def summarize(
    out_dir: str | os.PathLike,
    data: MMDUData | None = None,
    *,
    judge_info: dict | None = None,
    extra: dict | None = None,
) -> dict[str, Any]:
    """Phase 3: ``summary.json`` from the result files (judged when present, else answers)."""
    out = Path(out_dir)
    cfg = {}
    if (out / CONFIG_FILE).exists():
        with open(out / CONFIG_FILE, encoding="utf-8") as f:
            cfg = json.load(f)
    answers = load_finished(out / ANSWERS_FILE)
    judged = load_finished(out / JUDGED_FILE) if judge_info is not None else {}
    if data is not None:
        ids = [d.id for d in data.dialogs]
        answers = {k: answers[k] for k in ids if k in answers}
        judged = {k: judged[k] for k in ids if k in judged}
    rows = [r for rs in answers.values() for r in rs]
    answered = [r for r in rows if r.get("skipped") is None and r.get("answer") is not None]
    summary: dict[str, Any] = {
        "benchmark": "MMDU",
        "model": cfg.get("model"),
        "policy": cfg.get("policy"),
        "budget": cfg.get("budget"),
        "max_new_tokens": cfg.get("max_new_tokens"),
        "cache_kwargs": cfg.get("cache_kwargs"),
        "n_dialogs": len(data.dialogs) if data is not None else len(answers),
        "n_dialogs_answered": len(answers),
        "n_questions": len(rows),
        "n_answered": len(answered),
        "n_skipped": len(rows) - len(answered),
        "rouge_l": mean(r["rouge_l"] for r in answered if r.get("rouge_l") is not None),
        "n_stopped": sum(1 for r in answered if r.get("stopped")),
        "mean_new_tokens": mean(r.get("n_new_tokens", 0) for r in answered),
        "judge": judge_info,
        "scores": None,
        "n_judged": 0,
        "n_parse_failures": None,
        "n_incomplete": None,
        "n_judge_errors": None,
    }
    if judge_info is not None:
        jrows = [r for rs in judged.values() for r in rs if r.get("skipped") is None and r.get("answer") is not None]
        agg = aggregate([r.get("scores") for r in jrows])
        summary.update(
            scores={"all": agg["all"], "valid": agg["valid"], "n_valid": agg["n_valid"]},
            n_judged=agg["n_judged"],
            n_parse_failures=agg["n_parse_failures"],
            n_incomplete=agg["n_incomplete"],
            n_judge_errors=sum(1 for r in jrows if r.get("judge_error")),
            n_dialogs_judged=len(judged),
            score_keys=list(SCORE_KEYS),
            score_note="mean over judged questions x10; all: parse failures / missing keys count 0; valid: parsed only",
        )
    kv_final = [rs[-1].get("kv_bytes") for rs in answers.values() if rs]
    kv_final = [k for k in kv_final if isinstance(k, dict) and k.get("total") is not None]
    kv_records = [r["kv_bytes"] for r in answered if isinstance(r.get("kv_bytes"), dict) and r["kv_bytes"].get("total") is not None]
    kv_turns = [k["total"] for k in kv_records]
    summary["kv_bytes"] = (
        {
            "mean_per_turn_total": mean(kv_turns),
            "max_per_turn_total": max(kv_turns) if kv_turns else None,
            "max_after_eviction": max(k.get("max_after_eviction", k["total"]) for k in kv_records),
            "mean_dialog_final_total": mean(k["total"] for k in kv_final),
        }
        if kv_turns
        else None
    )
    if data is not None:
        summary["data"] = data.summary()
        summary["data_problems"] = [p.to_dict() for p in data.problems]
    summary["skipped_questions"] = [
        {"dialog_id": r["dialog_id"], "turn": r["turn"], "reason": r["skipped"]} for r in rows if r.get("skipped")
    ]
    if extra:
        summary.update(extra)
    with open(out / SUMMARY_FILE, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, ensure_ascii=False, default=str)
    return summary


def run_mmdu(
    model,
    processor,
    data: MMDUData,
    out_dir: str | os.PathLike,
    *,
    policy: str,
    budget,
    judge: Any = None,
    max_new_tokens: int = 2048,
    config: dict | None = None,
    cache_factory: Callable | None = None,
    cache_kwargs: dict | None = None,
    progress: bool = True,
    release_model: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Answer, judge, summarize. ``judge``: None (no judge), a judge callable, or a folder path
    loaded as :class:`LocalJudge` after generation (``release_model`` is called first, so the
    caller can free the answering model)."""
    counts = generate_answers(
        model,
        processor,
        data,
        out_dir,
        policy=policy,
        budget=budget,
        max_new_tokens=max_new_tokens,
        config=config,
        cache_factory=cache_factory,
        cache_kwargs=cache_kwargs,
        progress=progress,
    )
    judge_info = None
    jcounts: dict[str, int] = {}
    if judge is not None:
        if isinstance(judge, (str, os.PathLike)):
            if release_model is not None:
                release_model()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

            judge = LocalJudge(judge)
        judge_info = judge_name(judge)
        jcounts = judge_answers(judge, out_dir, dialog_ids=[d.id for d in data.dialogs], progress=progress)
    return summarize(out_dir, data, judge_info=judge_info, extra={"counts": {**counts, **jcounts}})
