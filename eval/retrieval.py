"""Planted-fact retrieval on a real text model, compressed cache vs full cache.

One trial: take ``context`` tokens of a real text (a different stretch of the file per trial
index), insert a sentence such as ``"The secret code of the blue door is 4821."`` at a relative
``depth`` (snapped to the next sentence end), append the question through the tokenizer's chat
template, prefill everything into a fresh cache, greedy-generate a few tokens and score exact
match: the first number in the answer (thousands commas removed) must equal the code.

Every trial is run with the policy's cache and with the full cache (or the full-cache answers
come from ``reference=``, a previous ``retrieval(..., policy="full")`` result on the same
settings). Small models miss planted facts beyond ~1K tokens even with the full cache, so the
numbers to read are the ones relative to the full cache:

* ``accuracy`` / ``full_accuracy``: exact-match rates;
* ``relative_accuracy``: accuracy / full_accuracy (None when the full cache found nothing);
* ``retained``: of the trials the full cache got right, the fraction the policy also got right;
* ``agreement``: fraction of trials whose answer text equals the full cache's.

Trials are deterministic given ``seed`` (facts) and ``offset`` (text position).
"""

from __future__ import annotations

import random
import re
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from vlm_kv.api import cache_kwarg, make_cache
from vlm_kv.cache import report

__all__ = ["retrieval", "build_trials", "score_answer", "cache_bytes"]

_COLORS = ("blue", "red", "green", "yellow", "silver", "black", "white", "purple", "orange", "golden")
_OBJECTS = ("door", "box", "lamp", "gate", "chest", "window", "bottle", "clock", "cabinet", "bridge")
_NUMBER = re.compile(r"\d[\d,]*")


def score_answer(answer: str, code: str) -> bool:
    """Exact match: the first number in ``answer`` (commas dropped) equals ``code``."""
    m = _NUMBER.search(answer or "")
    return bool(m) and m.group(0).replace(",", "") == str(code)


def cache_bytes(cache) -> tuple[int, int]:
    """(key/value bytes held now, the most held right after an eviction step) of a compressed cache
    or a DynamicCache (``vlm_kv.cache.report.peak_after_eviction``)."""
    return report.cache_bytes(cache), report.peak_after_eviction(cache)


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def _haystack(tokenizer, text: str, start: int, context: int) -> str:
    """``context`` tokens of ``text`` from character ``start``, decoded back to a string."""
    chunk = text[start : start + context * 12]
    ids = tokenizer(chunk, add_special_tokens=False).input_ids
    if len(ids) < context:
        raise ValueError(f"the text has only {len(ids)} tokens from character {start}, {context} needed")
    return tokenizer.decode(ids[:context], skip_special_tokens=True)


def _insert(doc: str, fact: str, depth: float) -> str:
    """``fact`` after the first sentence end at or after ``depth`` of ``doc`` (0 = start, 1 = end)."""
    pos = int(round(depth * len(doc)))
    if pos <= 0:
        return f"{fact} {doc.lstrip()}"
    if pos >= len(doc):
        return f"{doc.rstrip()} {fact}"
    m = re.compile(r"[.!?][\"')\]]?\s|\n").search(doc, pos, min(len(doc), pos + 400))
    if m is None:
        space = doc.find(" ", pos)
        cut = space if space != -1 else pos
    else:
        cut = m.end()
    head, tail = doc[:cut].rstrip(), doc[cut:].lstrip()
    return f"{head} {fact} {tail}"


def build_trials(
    tokenizer,
    text_path: str,
    context: int,
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    trials: int = 3,
    offset: int = 0,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """The trial specs (depth, trial, key, code, question, document) the runs share."""
    if context < 1 or trials < 1 or not depths:
        raise ValueError("retrieval needs context >= 1, trials >= 1 and at least one depth")
    for d in depths:
        if not 0.0 <= float(d) <= 1.0:
            raise ValueError(f"depths must be in [0, 1], got {d}")
    text = _read_text(text_path)
    need = context * 12
    if offset >= len(text):
        raise ValueError(f"offset {offset} is past the end of {text_path} ({len(text)} characters)")
    span = max(1, len(text) - offset - need)
    specs = []
    for t in range(trials):
        start = offset + (t * need) % span  # a different stretch of the text per trial index
        doc = _haystack(tokenizer, text, start, context)
        for di, depth in enumerate(depths):
            rng = random.Random(f"{seed}/{t}/{di}")
            key = f"{rng.choice(_COLORS)} {rng.choice(_OBJECTS)}"
            code = str(rng.randint(1000, 9999))
            fact = f"The secret code of the {key} is {code}."
            specs.append(
                {
                    "depth": float(depth),
                    "trial": t,
                    "text_offset": start,
                    "key": key,
                    "code": code,
                    "question": f"What is the secret code of the {key}?",
                    "document": _insert(doc, fact, float(depth)),
                }
            )
    return specs


def _prompt_ids(tokenizer, spec: dict) -> dict:
    content = f"{spec['document']}\n\nQuestion: {spec['question']} Answer with the number only."
    if getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        return {k: v for k, v in dict(enc).items() if isinstance(v, torch.Tensor)}
    enc = tokenizer(content + "\nAnswer:", return_tensors="pt")
    return {k: v for k, v in dict(enc).items() if isinstance(v, torch.Tensor)}




@torch.no_grad()
def _answer(model, tokenizer, inputs: dict, cache, max_new_tokens: int) -> str:
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs.items()}
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    kwargs = {cache_kwarg(model): cache}
    out = model.generate(**inputs, **kwargs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def _run(model, tokenizer, specs, inputs, new_cache, max_new_tokens, progress, label) -> list[dict]:
    out = []
    for spec, enc in tqdm(list(zip(specs, inputs)), desc=label, disable=not progress, leave=False):
        cache = new_cache()
        answer = _answer(model, tokenizer, enc, cache, max_new_tokens)
        held, peak = cache_bytes(cache)
        out.append({"answer": answer, "correct": score_answer(answer, spec["code"]), "kv_bytes": held,
                    "max_kv_bytes": peak})
        del cache
    return out


def _mean(xs) -> float | None:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else None


def retrieval(
    model,
    tokenizer,
    text_path: str,
    context: int,
    policy: str,
    budget,
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    trials: int = 3,
    *,
    offset: int = 0,
    seed: int = 0,
    max_new_tokens: int = 16,
    reference: dict | None = None,
    progress: bool = False,
    **cache_kwargs,
) -> dict[str, Any]:
    """Planted-fact retrieval accuracy of ``policy`` at ``budget``, and relative to the full cache.

    ``context``: haystack tokens (the prompt adds the fact, question and chat template).
    ``depths`` x ``trials`` prompts. ``reference``: a ``retrieval(..., policy="full")`` result
    with the same settings, reused instead of rerunning the full cache. ``cache_kwargs`` go to
    ``vlm_kv.make_cache`` (e.g. ``evict_every``, ``gates``). Returns a dict: settings,
    ``accuracy``, ``full_accuracy``, ``relative_accuracy``, ``retained``, ``agreement``,
    ``by_depth`` / ``full_by_depth`` (accuracy per depth), ``kv_bytes`` (mean held after
    generation), ``max_kv_bytes``, ``full_kv_bytes``, ``prompt_tokens`` (mean) and ``records``
    (one per trial).
    """
    depths = tuple(float(d) for d in depths)
    specs = build_trials(tokenizer, text_path, context, depths, trials, offset, seed)
    inputs = [_prompt_ids(tokenizer, s) for s in specs]
    # build one cache up front: a bad policy / budget / missing gates fails before any generation
    make_cache(model, policy=policy, budget=budget, **cache_kwargs)

    def new_cache():
        return make_cache(model, policy=policy, budget=budget, **cache_kwargs)

    runs = _run(model, tokenizer, specs, inputs, new_cache, max_new_tokens, progress, f"retrieval {policy} @ {budget}")

    if policy == "full":
        full = runs
    elif reference is not None:
        full = reference.get("records") or []
        if len(full) != len(specs) or any(
            (r.get("key"), r.get("code"), r.get("depth")) != (s["key"], s["code"], s["depth"]) for r, s in zip(full, specs)
        ):
            raise ValueError("retrieval reference was run with other settings (trials, depths, seed or text differ)")
        full = [{"answer": r["full_answer"], "correct": r["full_correct"], "kv_bytes": r["full_kv_bytes"],
                 "max_kv_bytes": r["full_kv_bytes"]} for r in full]
    else:
        full = _run(model, tokenizer, specs, inputs, lambda: DynamicCache(config=model.config), max_new_tokens,
                    progress, "retrieval full cache")

    records = []
    for spec, enc, r, f in zip(specs, inputs, runs, full):
        records.append(
            {
                "depth": spec["depth"],
                "trial": spec["trial"],
                "text_offset": spec["text_offset"],
                "key": spec["key"],
                "code": spec["code"],
                "prompt_tokens": int(enc["input_ids"].shape[1]),
                "answer": r["answer"],
                "correct": r["correct"],
                "kv_bytes": r["kv_bytes"],
                "max_kv_bytes": r["max_kv_bytes"],
                "full_answer": f["answer"],
                "full_correct": f["correct"],
                "full_kv_bytes": f["kv_bytes"],
            }
        )
    acc = _mean(float(r["correct"]) for r in records)
    full_acc = _mean(float(r["full_correct"]) for r in records)
    full_right = [r for r in records if r["full_correct"]]
    return {
        "policy": policy,
        "budget": budget,
        "context": context,
        "depths": list(depths),
        "trials": trials,
        "n": len(records),
        "accuracy": acc,
        "full_accuracy": full_acc,
        "relative_accuracy": (acc / full_acc) if full_acc else None,
        "retained": _mean(float(r["correct"]) for r in full_right),
        "agreement": _mean(float(r["answer"] == r["full_answer"]) for r in records),
        "by_depth": {str(d): _mean(float(r["correct"]) for r in records if r["depth"] == d) for d in depths},
        "full_by_depth": {str(d): _mean(float(r["full_correct"]) for r in records if r["depth"] == d) for d in depths},
        "kv_bytes": int(round(_mean(r["kv_bytes"] for r in records))),
        "max_kv_bytes": max(r["max_kv_bytes"] for r in records),
        "full_kv_bytes": int(round(_mean(r["full_kv_bytes"] for r in records))),
        "prompt_tokens": _mean(r["prompt_tokens"] for r in records),
        "records": records,
    }
