"""The multimodal benchmark: how a cache policy treats the visual tokens a question depends on.

    bench = MultimodalBench(model, processor, MultimodalSettings(data_seed=1, items=20))
    rows = bench.run("dbtrimkv", 0.1)          # one row per task (single, multi_image, multi_turn)

Items come from the generated tasks (``vlm_kv.eval.visual_tasks``) under ``data_seed`` (the
shipped smollava was trained on seed 0 only; any other seed is held out). For each item the
model answers every question greedily on one cache, turn by turn (``answer``): a multi-turn item
asks its later questions after the images were prefilled and compressed. Per (policy, budget,
task) the row holds:

* ``accuracy``: exact match of the generated answers; ``full_accuracy`` the full cache's on the
  same items; ``relative_accuracy`` their ratio; ``chance`` a blind guess's expected accuracy;
  ``turn_accuracy``: accuracy per turn (multi-turn: a scorer that chose by the first question
  may lose what turn 3 asks about);
* ``kl``: KL(full || compressed) of the next-token distributions at the answer tokens, teacher
  forced with the true answers, fed turn by turn as a chat runs (nats per answer token);
* ``kv_bytes``: key/value bytes held at the end; ``max_kv_bytes``: the most held right after an
  eviction step; ``full_kv_bytes``: what the uncompressed cache holds for the same tokens
  (per item, averaged);
* ``visual_share`` and ``visual_share_per_layer``: the share of kept entries that are image
  tokens (all layers, and per layer), averaged over items.

The full cache's pass (answers, and the log-probs every KL is taken against) is the costliest
part of a sweep process. With ``reference_dir`` it is saved there per task
(``full_reference_<task>.pt``) and reused by any later process whose settings, model weights and
dtype match (a mismatch recomputes and overwrites it), so a resumed or a second sweep of the same
items (other cache settings) skips it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from vlm_kv.api import make_cache
from vlm_kv.eval.visual_qa import IGNORE, answer, conversation_pieces, encode_pieces
from vlm_kv.eval.visual_tasks import (
    KINDS,
    TASKS,
    Item,
    answer_matches,
    chance,
    make_item,
)
from vlm_kv.models.smollava import pixel_values

__all__ = ["MultimodalSettings", "MultimodalBench", "ROW_FIELDS"]

FULL = "full"
ROW_FIELDS = ("policy", "budget", "task", "items", "accuracy", "full_accuracy", "relative_accuracy", "chance", "kl",
              "kv_bytes", "full_kv_bytes", "max_kv_bytes", "visual_share", "error")


@dataclass
class MultimodalSettings:
    data_seed: int = 1
    items: int = 20                       # items per task
    tasks: tuple[str, ...] = TASKS
    images: str = "real"                  # "noise": pixels replaced by noise (the reads-its-images control)
    kinds: tuple[str, ...] = KINDS
    max_new_tokens: int = 8

    def validate(self) -> None:
        unknown = set(self.tasks) - set(TASKS)
        if unknown or not self.tasks:
            raise ValueError(f"tasks must be a non-empty subset of {', '.join(TASKS)}, got {', '.join(self.tasks)}")
        if self.items < 1:
            raise ValueError(f"items must be >= 1, got {self.items}")
        if self.images not in ("real", "noise"):
            raise ValueError(f"images must be 'real' or 'noise', got {self.images!r}")


@dataclass
class _ItemResult:
    hits: list[bool]
    answers: list[str]
    kl: float
    kv_bytes: int
    max_kv_bytes: int
    full_kv_bytes: int
    visual_per_layer: list[float] = field(default_factory=list)


def _kv_bytes(cache) -> int:
    if hasattr(cache, "kv_bytes"):
        return int(cache.kv_bytes()["total"])
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def _visual_share_per_layer(cache) -> list[float]:
    """Share of each layer's kept entries that are image tokens (modality 1); [] for a full cache."""
    out = []
    for layer in getattr(cache, "layers", []):
        store = getattr(layer, "store", None)
        if store is None:
            continue
        counts = store.modality_counts().double()
        tier = getattr(layer, "tier", None)
        if tier is not None:
            counts = counts + tier.modality_counts(counts.numel()).double().to(counts.device)
        total = float(counts.sum())
        out.append(float(counts[1:].sum()) / total if total else 0.0)
    return out


class MultimodalBench:
    """Runs the generated tasks with the full cache once, then any (policy, budget) against it."""

    def __init__(self, model, processor, settings: MultimodalSettings, cache_kwargs: dict | None = None,
                 progress: bool = False, reference_dir: str | os.PathLike | None = None):
        settings.validate()
        self.model, self.tokenizer = model, getattr(processor, "tokenizer", processor)
        self.settings = settings
        self.cache_kwargs = dict(cache_kwargs or {})
        self.progress = progress
        self.reference_dir = Path(reference_dir) if reference_dir is not None else None
        self._items: dict[str, list[Item]] = {}
        self._reference: dict[str, list[tuple[list[bool], list[torch.Tensor], int]]] = {}

    def items(self, task: str) -> list[Item]:
        if task not in self._items:
            s = self.settings
            self._items[task] = [make_item(task, s.data_seed, i, images=s.images, kinds=s.kinds)
                                 for i in range(s.items)]
        return self._items[task]

    # -- the two passes over one item -----------------------------------------------------------
    def _segments(self, item: Item) -> tuple[list[int], list[int], list[int]]:
        """Token ids and labels of the teacher-forced chat, and where each turn's forward ends
        (the first prompt, then each answer with the next question)."""
        ids, labels = encode_pieces(self.tokenizer, conversation_pieces(item, [q.answer for q in item.questions]))
        ends = []
        for k in range(1, len(item.questions) + 1):
            prompt = encode_pieces(self.tokenizer, conversation_pieces(item, [q.answer for q in item.questions[:k - 1]], k))[0]
            ends.append(len(prompt))
        ends.append(len(ids))
        return ids, labels, ends

    @torch.no_grad()
    def _forced_logprobs(self, item: Item, cache) -> tuple[list[torch.Tensor], int, int]:
        """Log-probs predicting each answer token, fed turn by turn on ``cache``; bytes held."""
        device = next(self.model.parameters()).device
        dtype = next(self.model.parameters()).dtype
        ids, labels, ends = self._segments(item)
        ids_t = torch.tensor([ids], device=device)
        logits_parts, start = [], 0
        max_bytes = 0
        for end in ends:
            kwargs = {"pixel_values": pixel_values(item.images).to(device, dtype)} if start == 0 else {}
            out = self.model(input_ids=ids_t[:, start:end], attention_mask=torch.ones_like(ids_t[:, :end]),
                             past_key_values=cache, use_cache=True, **kwargs)
            logits_parts.append(out.logits[0].float().log_softmax(-1))
            max_bytes = max(max_bytes, _kv_bytes(cache))
            start = end
        logp = torch.cat(logits_parts)
        where = [t - 1 for t in range(1, len(labels)) if labels[t] != IGNORE]
        # a copy of the answer rows: views would keep every position's [T, vocab] log-probs alive
        # (16 eight-image chats held 7.7 GB that way)
        return list(logp[where]), _kv_bytes(cache), max_bytes

    def _full(self, task: str):
        if task not in self._reference:
            ref = self._load_reference(task)
            if ref is None:
                ref = []
                for item in self._progress(self.items(task), f"{task} full cache"):
                    hits = [answer_matches(a, q.answer) for q, a in
                            zip(item.questions, answer(self.model, self.tokenizer, item, self.settings.max_new_tokens))]
                    logps, nbytes, _ = self._forced_logprobs(item, DynamicCache())
                    ref.append((hits, logps, nbytes))
                self._save_reference(task, ref)
            self._reference[task] = ref
        return self._reference[task]

    # -- the full cache's pass, kept on disk ----------------------------------------------------------
    @functools.cached_property
    def _weights_digest(self) -> str:
        # hashed once per bench (~1 s for smollava), not for every load and save
        digest = hashlib.sha256()
        for name, param in sorted(self.model.state_dict().items()):
            digest.update(name.encode())
            digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def reference_key(self, task: str) -> str:
        """What the full cache's pass depends on: the settings, the task, the weights and the dtype."""
        dtype = str(next(self.model.parameters()).dtype)
        return json.dumps({"settings": settings_dict(self.settings), "task": task, "dtype": dtype,
                           "weights": self._weights_digest}, sort_keys=True, default=list)

    def _reference_path(self, task: str) -> Path | None:
        return self.reference_dir / f"full_reference_{task}.pt" if self.reference_dir is not None else None

    def _load_reference(self, task: str):
        path = self._reference_path(task)
        if path is None or not path.is_file():
            return None
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved.get("key") != self.reference_key(task):
            return None  # another model, dtype or item set: recomputed and overwritten
        device = next(self.model.parameters()).device
        return [(list(hits), [t.to(device) for t in logps], int(nbytes)) for hits, logps, nbytes in saved["ref"]]

    def _save_reference(self, task: str, ref) -> None:
        path = self._reference_path(task)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"key": self.reference_key(task),
                    "ref": [(hits, [t.cpu() for t in logps], nbytes) for hits, logps, nbytes in ref]}, tmp)
        os.replace(tmp, path)

    def _progress(self, seq, desc):
        if not self.progress:
            return seq

        return tqdm(seq, desc=desc, leave=False)

    # -- rows ---------------------------------------------------------------------------------------
    def run(self, policy: str, budget) -> list[dict]:
        """One row per task of the settings."""
        return [self.run_task(policy, budget, task) for task in self.settings.tasks]

    def run_task(self, policy: str, budget, task: str) -> dict:
        start = time.time()
        ref = self._full(task)
        items = self.items(task)
        full_hits = [h for hits, _, _ in ref for h in hits]
        row = {"policy": policy, "budget": budget, "task": task, "items": len(items),
               "chance": float(np.mean([chance(it.questions) for it in items])),
               "full_accuracy": float(np.mean(full_hits)), "error": None}
        if policy == FULL:
            turns = _turn_accuracy([hits for hits, _, _ in ref])
            full_bytes = float(np.mean([b for _, _, b in ref]))
            row.update(accuracy=row["full_accuracy"], relative_accuracy=1.0, kl=0.0, kv_bytes=full_bytes,
                       full_kv_bytes=full_bytes, max_kv_bytes=full_bytes, visual_share=None,
                       visual_share_per_layer=None, turn_accuracy=turns,
                       questions=_question_records(items, [hits for hits, _, _ in ref]),
                       seconds=round(time.time() - start, 2))
            return row
        results = []
        try:
            for item, (_, ref_logps, full_bytes) in zip(self._progress(items, f"{task} {policy} {budget}"), ref):
                results.append(self._run_item(item, policy, budget, ref_logps, full_bytes))
        except ValueError as err:  # a policy that cannot run here (no gates, impossible budget): say why
            row.update(error=f"{type(err).__name__}: {err}", seconds=round(time.time() - start, 2))
            return row
        hits = [h for r in results for h in r.hits]
        acc = float(np.mean(hits))
        per_layer = np.mean([r.visual_per_layer for r in results], axis=0).tolist() if results[0].visual_per_layer else None
        row.update(accuracy=acc,
                   relative_accuracy=acc / row["full_accuracy"] if row["full_accuracy"] else None,
                   kl=float(np.mean([r.kl for r in results])),
                   kv_bytes=float(np.mean([r.kv_bytes for r in results])),
                   max_kv_bytes=float(np.mean([r.max_kv_bytes for r in results])),
                   full_kv_bytes=float(np.mean([r.full_kv_bytes for r in results])),
                   visual_share=float(np.mean(per_layer)) if per_layer else None,
                   visual_share_per_layer=per_layer,
                   turn_accuracy=_turn_accuracy([r.hits for r in results]),
                   questions=_question_records(items, [hits for hits, _, _ in ref], results),
                   seconds=round(time.time() - start, 2))
        return row

    def _run_item(self, item: Item, policy: str, budget, ref_logps: list[torch.Tensor], full_bytes: int) -> _ItemResult:
        cache = make_cache(self.model, policy, budget, **self.cache_kwargs)
        answers = answer(self.model, self.tokenizer, item, self.settings.max_new_tokens, cache=cache)
        hits = [answer_matches(a, q.answer) for q, a in zip(item.questions, answers)]
        visual = _visual_share_per_layer(cache)
        forced = make_cache(self.model, policy, budget, **self.cache_kwargs)
        logps, held, _ = self._forced_logprobs(item, forced)
        kl = float(np.mean([float((p.exp() * (p - q)).sum()) for p, q in zip(ref_logps, logps)]))
        max_bytes = int(getattr(forced, "max_kv_bytes", held))
        return _ItemResult(hits, answers, kl, held, max_bytes, full_bytes, visual)


def _question_records(items: list[Item], full_hits: list[list[bool]],
                      results: list[_ItemResult] | None = None) -> list[dict]:
    """One record per question, so that a miss can be traced to its item, turn, image and kind without a
    rerun: ``correct`` is this cache's answer (the full cache's in the full row), ``full_correct`` the full
    cache's, ``given`` the answer this cache generated (compressed rows only: the saved full pass keeps hits)."""
    records = []
    for i, item in enumerate(items):
        for turn, q in enumerate(item.questions):
            record = {"item": item.index, "turn": turn + 1, "image": q.image_index, "images": len(item.scenes),
                      "kind": q.kind, "answer": q.answer, "full_correct": bool(full_hits[i][turn])}
            if results is None:
                record["correct"] = record["full_correct"]
            else:
                record.update(correct=bool(results[i].hits[turn]), given=results[i].answers[turn])
            records.append(record)
    return records


def _turn_accuracy(per_item_hits: list[list[bool]]) -> list[float]:
    turns = max(len(h) for h in per_item_hits)
    return [float(np.mean([h[k] for h in per_item_hits if len(h) > k])) for k in range(turns)]


def settings_dict(settings: MultimodalSettings) -> dict:
    return asdict(settings)
