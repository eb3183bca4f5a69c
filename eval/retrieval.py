"""Planted-fact retrieval on a real text model, compressed cache vs full cache.

One trial: take ``context`` tokens of a real text (a different stretch of the file per trial
index), insert a sentence such as ``"The secret code of the blue door is 4821."`` at a relative
``depth`` (snapped to the next sentence end), append the question through the tokenizer's chat
template, prefill everything into a fresh cache, greedy-generate a few tokens and score exact
match: the first number in the answer (thousands commas removed) must equal the code.

Where the question goes (``RetrievalSettings.ask``): ``"prompt"`` puts it after the document in
the same user turn, so a policy that scores by the last queries (SnapKV's observation window)
sees it while choosing; ``"later"`` prefills the document alone as a first turn (the cache is
compressed at the end of that forward, knowing nothing of the question), then asks in a second
turn on top of the compressed cache, as a chat over a document or a second question does.

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
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from vlm_kv.api import cache_kwarg, make_cache
from vlm_kv.cache import report
from vlm_kv.eval.planted_facts import COLORS, OBJECTS, READ_REPLY, READ_REQUEST, insert_at_depth
from vlm_kv.policies import policy_spec
from vlm_kv.reconstruction import kvzip_prefill

__all__ = ["retrieval", "build_trials", "score_answer", "cache_bytes", "RetrievalSettings", "ASK_MODES"]

ASK_MODES = ("prompt", "later")

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


@dataclass(frozen=True)
class RetrievalSettings:
    """What a retrieval run measures: ``context`` haystack tokens (the prompt adds the fact, the
    question and the chat template), ``depths`` x ``trials`` prompts, facts drawn from ``seed``,
    text read from character ``offset``, ``max_new_tokens`` greedy tokens an answer, and where the
    question goes (``ask``: ``"prompt"`` or ``"later"``, see the module docstring)."""

    context: int
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    trials: int = 3
    offset: int = 0
    seed: int = 0
    max_new_tokens: int = 16
    ask: str = "prompt"

    def __post_init__(self) -> None:
        object.__setattr__(self, "depths", tuple(float(d) for d in self.depths))
        if self.context < 1 or self.trials < 1 or not self.depths:
            raise ValueError("retrieval needs context >= 1, trials >= 1 and at least one depth")
        for d in self.depths:
            if not 0.0 <= d <= 1.0:
                raise ValueError(f"depths must be in [0, 1], got {d}")
        if self.ask not in ASK_MODES:
            raise ValueError(f"ask must be one of {ASK_MODES}, got {self.ask!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def build_trials(tokenizer, text_path: str, settings: RetrievalSettings) -> list[dict[str, Any]]:
    """The trial specs (depth, trial, key, code, question, document) the runs share."""
    context, depths, trials = settings.context, settings.depths, settings.trials
    offset, seed = settings.offset, settings.seed
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
            key = f"{rng.choice(COLORS)} {rng.choice(OBJECTS)}"
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
                    "document": insert_at_depth(doc, fact, float(depth)),
                }
            )
    return specs


def _chat_ids(tokenizer, messages: list[dict], generation_prompt: bool) -> torch.Tensor:
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, return_tensors="pt",
                                        return_dict=True)
    return enc["input_ids"]


def _prompt_ids(tokenizer, spec: dict, ask: str = "prompt") -> dict:
    """``input_ids`` of the whole prompt; with ``ask="later"`` also ``context_ids``, the document
    turn alone (a prefix of ``input_ids``), prefilled before the question is known."""
    question = f"Question: {spec['question']} Answer with the number only."
    chat = bool(getattr(tokenizer, "chat_template", None))
    if ask == "prompt":
        content = f"{spec['document']}\n\n{question}"
        if chat:
            return {"input_ids": _chat_ids(tokenizer, [{"role": "user", "content": content}], True)}
        return {"input_ids": tokenizer(content + "\nAnswer:", return_tensors="pt").input_ids}
    document = f"{spec['document']}\n\n{READ_REQUEST}"
    if chat:
        first = [{"role": "user", "content": document}, {"role": "assistant", "content": READ_REPLY}]
        context_ids = _chat_ids(tokenizer, first, False)
        input_ids = _chat_ids(tokenizer, first + [{"role": "user", "content": question}], True)
    else:
        context_ids = tokenizer(f"{document}\n{READ_REPLY}\n", return_tensors="pt").input_ids
        more = tokenizer(f"{question}\nAnswer:", add_special_tokens=False, return_tensors="pt").input_ids
        input_ids = torch.cat([context_ids, more], dim=1)
    n = context_ids.shape[1]
    if input_ids.shape[1] <= n or not torch.equal(input_ids[:, :n], context_ids):
        # fail closed: a template that rewrites earlier turns cannot be fed turn by turn
        raise ValueError("the chat template does not extend the document turn when the question is added; "
                         "ask='later' needs turn-by-turn prompts")
    return {"input_ids": input_ids, "context_ids": context_ids}




@torch.no_grad()
def _answer(model, tokenizer, inputs: dict, cache, max_new_tokens: int, reconstruct: bool = False,
            memo: dict | None = None) -> str:
    """Greedy answer on ``cache``. ``reconstruct`` (policy kvzip): the context (the document turn,
    or the whole prompt but its last token) is scored by reconstruction (kept in ``memo``) and
    prefilled first."""
    device = next(model.parameters()).device
    kwargs = {cache_kwarg(model): cache}
    input_ids = inputs["input_ids"].to(device)
    context = inputs.get("context_ids")
    if reconstruct:
        kvzip_prefill(model, cache, (context if context is not None else input_ids[:, :-1]).to(device), tokenizer,
                      memo=memo)
    elif context is not None:  # ask="later": the document turn is prefilled (and compressed) first
        model(input_ids=context.to(device), use_cache=True, **kwargs)
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs,
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    return tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True).strip()


def _run(model, tokenizer, specs, inputs, new_cache, max_new_tokens, progress, label,
         reconstruct: bool = False, memo: dict | None = None) -> list[dict]:
    out = []
    for spec, enc in tqdm(list(zip(specs, inputs)), desc=label, disable=not progress, leave=False):
        cache = new_cache()
        answer = _answer(model, tokenizer, enc, cache, max_new_tokens, reconstruct, memo)
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
    policy: str,
    budget,
    settings: RetrievalSettings,
    *,
    reference: dict | None = None,
    progress: bool = False,
    reconstruction_memo: dict | None = None,
    **cache_kwargs,
) -> dict[str, Any]:
    """Planted-fact retrieval accuracy of ``policy`` at ``budget``, and relative to the full cache.

    ``reference``: a ``retrieval(..., policy="full")`` result with the same settings, reused
    instead of rerunning the full cache. ``reconstruction_memo``: a dict kept across calls on one
    model, so kvzip reads each context back once for every budget. ``cache_kwargs`` go to ``vlm_kv.make_cache`` (``gates=``,
    ``tiers=``, ``options=``). Returns a dict: settings,
    ``accuracy``, ``full_accuracy``, ``relative_accuracy``, ``retained``, ``agreement``,
    ``by_depth`` / ``full_by_depth`` (accuracy per depth), ``kv_bytes`` (mean held after
    generation), ``max_kv_bytes``, ``full_kv_bytes``, ``prompt_tokens`` (mean) and ``records``
    (one per trial).
    """
    context, depths, trials, max_new_tokens = settings.context, settings.depths, settings.trials, settings.max_new_tokens
    specs = build_trials(tokenizer, text_path, settings)
    inputs = [_prompt_ids(tokenizer, s, settings.ask) for s in specs]
    # build one cache up front: a bad policy / budget / missing gates fails before any generation
    make_cache(model, policy=policy, budget=budget, **cache_kwargs)

    def new_cache():
        return make_cache(model, policy=policy, budget=budget, **cache_kwargs)

    reconstruct = policy != "full" and policy_spec(policy).needs_reconstruction  # kvzip: its scoring pass first
    runs = _run(model, tokenizer, specs, inputs, new_cache, max_new_tokens, progress, f"retrieval {policy} @ {budget}",
                reconstruct, reconstruction_memo)

    if policy == "full":
        full = runs
    elif reference is not None:
        full = reference.get("records") or []
        if reference.get("ask", "prompt") != settings.ask or len(full) != len(specs) or any(
            (r.get("key"), r.get("code"), r.get("depth")) != (s["key"], s["code"], s["depth"]) for r, s in zip(full, specs)
        ):
            raise ValueError("retrieval reference was run with other settings (trials, depths, seed, text or ask "
                             "differ)")
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
        "ask": settings.ask,
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
