"""Training sequences for gate training.

Sources (any mix, one ``--data`` file each):

* plain text files: the whole file is one document;
* JSONL with ``{"text": ...}``: one document per line;
* VLM conversation JSONL, LLaVA style
  ``{"conversations": [{"from": "human"|"gpt", "value": "...<image>...<video>..."}], "image": path | [paths],
  "video": [frame paths] | [[frame paths], ...]}``
  or messages style ``{"messages": [{"role": ..., "content": str | [{"type": "image", "image": path},
  {"type": "video", "video": [frame paths]}, {"type": "text", "text": ...}]}]}``; paths are relative
  to the JSONL file's folder. A video is a list of frame images, in order.

Qwen VL processors get their images (and videos) through qwen-vl-utils' sizing
(``vlm_kv.models.vision_inputs``: ``min_pixels`` / ``max_pixels``, default the processor's own limits).
Videos go through the processor's video processor (transformers needs torchvision for it).

Text documents are tokenized, joined with EOS and packed into ``max_length`` chunks (a tail
shorter than half a chunk is dropped unless it is the only one). Each conversation is one
sample, rendered through the model's processor (``apply_chat_template`` with PIL images) and
truncated to ``max_length`` (an image whose placeholder tokens would be cut is dropped with
everything after it).

Planted facts (``FactsMix``, ``--facts-share``): a share of the text samples become chats. The
sample's text, cut to leave room, holds a few planted facts (codes, names, dates, lists) and is
followed by one question a turn, each answered, so the distillation loss (every next token)
covers answers that only a cache which kept the fact can give (``vlm_kv.eval.planted_facts``).
Which samples, and their facts, are a function of the seed and the sample number. With facts
on, every sample also carries ``answer_mask`` ([1, T] bool, on the label positions whose next
token belongs to an answer turn), so the loop can weigh those few tokens up
(``TrainConfig.answer_weight``); they are ~2% of a 1024-token chat.

Order: sample ``k`` of the stream is ``perm(epoch)[k % n]`` with ``epoch = k // n`` and
``perm(e)`` a permutation drawn from ``seed + e``. The data position is the single integer
``k`` (``position``), so saving and restoring it resumes the stream exactly.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from vlm_kv.eval.planted_facts import FACT_KINDS, facts_chat
from vlm_kv.models.vision_inputs import is_qwen_vl_processor, qwen_vision_info

IGNORE = -100
#: tokens kept free in a planted-fact chat for what re-tokenizing the text around the facts adds
ROOM_SLACK = 16


@dataclass
class _Conversation:
    messages: list  # messages-style, image items hold paths (loaded lazily)


def _llava_to_messages(record: dict) -> list:
    images = record.get("image", record.get("images")) or []
    if isinstance(images, str):
        images = [images]
    images = list(images)
    videos = record.get("video", record.get("videos")) or []
    if videos and all(isinstance(v, str) for v in videos):
        videos = [videos]  # one video: a list of frames
    videos = [list(v) for v in videos]
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
    messages = []
    for turn in record["conversations"]:
        role = roles.get(turn.get("from", "human"), "user")
        parts = re.split(r"(<image>|<video>)", turn.get("value", ""))
        content: list[dict] = []
        n_tags = sum(1 for part in parts if part in ("<image>", "<video>"))
        for part in parts:
            if part == "<image>":
                if not images:
                    raise ValueError("conversation has more <image> tags than images")
                content.append({"type": "image", "image": images.pop(0)})
                continue
            if part == "<video>":
                if not videos:
                    raise ValueError("conversation has more <video> tags than videos")
                content.append({"type": "video", "video": videos.pop(0)})
                continue
            part = part.strip("\n") if n_tags else part
            if part:
                content.append({"type": "text", "text": part})
        messages.append({"role": role, "content": content})
    if images or videos:  # media without a tag: put them in front of the first user turn
        first = next((m for m in messages if m["role"] == "user"), messages[0])
        first["content"] = ([{"type": "image", "image": p} for p in images]
                            + [{"type": "video", "video": v} for v in videos] + first["content"])
    return messages


def read_source(path: str, base: str | None = None) -> tuple[list[str], list[_Conversation]]:
    """The text documents and the conversations of one data file; media paths of a JSONL file are
    resolved against ``base`` (default: the file's own folder)."""
    texts: list[str] = []
    convs: list[_Conversation] = []
    if not path.endswith((".jsonl", ".json")):
        with open(path, encoding="utf-8", errors="replace") as fh:
            texts.append(fh.read())
        return texts, convs
    base = os.path.abspath(base) if base is not None else os.path.dirname(os.path.abspath(path))

    def resolve(p: str) -> str:
        return p if os.path.isabs(p) else os.path.join(base, p)

    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if "text" in rec and "conversations" not in rec and "messages" not in rec:
                texts.append(rec["text"])
                continue
            if "conversations" in rec:
                messages = _llava_to_messages(rec)
            elif "messages" in rec:
                messages = [dict(m) for m in rec["messages"]]
            else:
                raise ValueError(f"{path}:{n}: expected a 'text', 'conversations' or 'messages' field")
            for m in messages:
                if isinstance(m.get("content"), list):
                    m["content"] = [_resolve_item(c, resolve) for c in m["content"]]
            convs.append(_Conversation(messages))
    return texts, convs


def _resolve_item(item: dict, resolve) -> dict:
    if item.get("type") == "image" and isinstance(item.get("image"), str):
        return dict(item, image=resolve(item["image"]))
    if item.get("type") == "video":
        frames = item.get("video")
        if not isinstance(frames, list) or not frames or not all(isinstance(f, str) for f in frames):
            raise ValueError(f"a video item needs a non-empty list of frame paths, got {frames!r}")
        return dict(item, video=[resolve(f) for f in frames])
    return item


def _load_media(item: dict) -> dict:
    def load(path: str):
        with Image.open(path) as im:
            return im.convert("RGB")

    if item.get("type") == "image" and isinstance(item.get("image"), str):
        return dict(item, image=load(item["image"]))
    if item.get("type") == "video":
        return dict(item, video=[load(f) if isinstance(f, str) else f for f in item["video"]])
    return item


def prepare_chat(processor: Any, messages: list[dict], pixel_limits: dict) -> tuple[list[dict], dict]:
    """``messages`` with their media loaded (Qwen VL: sized by qwen-vl-utils within
    ``pixel_limits``) and the keyword arguments :func:`render_chat` passes the processor."""
    loaded = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [_load_media(c) for c in content]
        loaded.append({"role": m["role"], "content": content})
    kwargs: dict[str, Any] = {}
    if is_qwen_vl_processor(processor):  # qwen-vl-utils sizing; the processor keeps it
        images, videos, video_kwargs = qwen_vision_info(loaded, processor, **pixel_limits)
        images, videos = iter(images or []), iter(videos or [])
        loaded = [{"role": m["role"], "content": [
            dict(c, image=next(images)) if c.get("type") == "image" else
            dict(c, video=next(videos)) if c.get("type") == "video" else c
            for c in m["content"]]} if isinstance(m["content"], list) else m for m in loaded]
        kwargs = {"do_resize": False, **video_kwargs}
    elif any(v is not None for v in pixel_limits.values()):
        raise ValueError(f"min_pixels / max_pixels apply to Qwen VL processors, not {type(processor).__name__}")
    return loaded, kwargs


def render_chat(processor: Any, messages: list[dict], kwargs: dict, add_generation_prompt: bool) -> dict:
    """The tensors of ``messages`` (prepared by :func:`prepare_chat`) through the processor's chat template."""
    enc = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                        add_generation_prompt=add_generation_prompt, **kwargs)
    return {k: v for k, v in dict(enc).items() if isinstance(v, torch.Tensor)}


@dataclass(frozen=True)
class FactsMix:
    """``share`` of the text samples turned into planted-fact chats of ``per_sample`` facts."""

    share: float
    per_sample: int = 3
    kinds: tuple[str, ...] = FACT_KINDS

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"facts share must be in [0, 1], got {self.share}")
        if self.per_sample < 1:
            raise ValueError(f"facts per sample must be >= 1, got {self.per_sample}")
        unknown = set(self.kinds) - set(FACT_KINDS)
        if unknown or not self.kinds:
            raise ValueError(f"fact kinds must be a non-empty subset of {FACT_KINDS}, got {self.kinds}")


class TrainingData:
    """A deterministic, resumable stream of training samples (dicts of [1, T] tensors)."""

    def __init__(self, files: list[str], processor: Any, max_length: int, seed: int = 0,
                 image_token_id: int | None = None, video_token_id: int | None = None,
                 min_pixels: int | None = None, max_pixels: int | None = None, facts: FactsMix | None = None,
                 answer_turns: bool = False) -> None:
        if max_length < 2:
            raise ValueError("max_length must be >= 2")
        self.files = list(files)
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.max_length = max_length
        self.seed = seed
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.pixel_limits = {"min_pixels": min_pixels, "max_pixels": max_pixels}
        self.facts = facts if facts is not None and facts.share > 0 else None
        if self.facts is not None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("planted-fact samples are chats: the tokenizer has no chat template")
        texts: list[str] = []
        self.conversations: list[_Conversation] = []
        for f in self.files:
            t, c = read_source(f)
            texts += t
            self.conversations += c
        self.chunks = self._pack(texts)
        self.samples: list[tuple[str, int]] = [("text", i) for i in range(len(self.chunks))]
        self.samples += [("conv", i) for i in range(len(self.conversations))]
        if not self.samples:
            raise ValueError(f"no training samples in {self.files}")
        # conversations' assistant turns as answers (the visual-facts recipe: questions about
        # images asked after them, answered in the assistant turns)
        self.answer_turns = answer_turns and bool(self.conversations)
        if answer_turns and not self.conversations and self.facts is None:
            raise ValueError(f"answer turns were asked for, but {self.files} hold no conversations "
                             "(only text: use planted-fact chats, --facts-share, for answers)")
        self.position = 0
        self._perm_epoch = -1
        self._perm: list[int] = []

    # ---------------------------------------------------------------- text

    def _pack(self, texts: list[str]) -> list[torch.Tensor]:
        if not texts:
            return []
        eos = self.tokenizer.eos_token_id
        ids: list[int] = []
        for text in texts:
            ids += self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if eos is not None:
                ids.append(eos)
        stream = torch.tensor(ids, dtype=torch.long)
        t = self.max_length
        chunks = [stream[i : i + t] for i in range(0, len(stream), t)]
        if len(chunks) > 1 and len(chunks[-1]) < t // 2:
            chunks.pop()
        return [c for c in chunks if len(c) >= 2]

    # ---------------------------------------------------------------- conversations

    def _render(self, conv: _Conversation, with_answers: bool = False) -> dict:
        """The conversation through the processor, truncated to max_length; with ``with_answers``
        also ``answer_mask`` [1, T]: the label positions that predict an assistant turn's tokens
        (whole turns only: a turn cut by the truncation is not marked)."""
        messages, kwargs = prepare_chat(self.processor, conv.messages, self.pixel_limits)

        def render(msgs: list[dict], prompt: bool) -> dict:
            return render_chat(self.processor, msgs, kwargs, add_generation_prompt=prompt)

        out = render(messages, False)
        answers = self._assistant_turns(messages, out["input_ids"][0], render) if with_answers else None
        out = self._truncate(out)
        if answers is not None:
            out["answer_mask"] = answers[: out["input_ids"].shape[1]][None]
        return out

    @staticmethod
    def _assistant_turns(messages: list[dict], ids: torch.Tensor, render) -> torch.Tensor:
        """[T] bool: label positions whose next token is in an assistant turn (its text and end
        marker), found by rendering each prefix; fails closed when the template does not render a
        conversation as the concatenation of its turns."""
        answers = torch.zeros(len(ids), dtype=torch.bool)
        for turn, m in enumerate(messages):
            if m["role"] != "assistant" or turn == 0:
                continue
            start = render(messages[:turn], True)["input_ids"].shape[1]
            upto = render(messages[: turn + 1], False)["input_ids"][0]
            stop = len(upto)
            if not (0 < start < stop <= len(ids)) or not torch.equal(ids[:stop], upto):
                raise ValueError("the chat template does not render a conversation as the concatenation of its "
                                 "turns; its answer tokens cannot be located")
            answers[start - 1: stop - 1] = True
        return answers

    def _truncate(self, enc: dict) -> dict:
        ids = enc["input_ids"]
        t = self.max_length
        if ids.shape[1] <= t:
            return enc
        if "pixel_values_videos" in enc:  # cutting a video's frames apart is not supported: refuse
            raise ValueError(f"a video conversation of {ids.shape[1]} tokens is longer than max_length {t}; "
                             "raise max_length or use fewer / smaller frames")
        placeholder = {x for x in (self.image_token_id, self.video_token_id) if x is not None}
        row = ids[0].tolist()
        # keep the images whose placeholder run ends inside [0, t); cut before one that straddles t
        keep_images, cut, dropped_at = 0, t, None
        for i, j in _runs(row, placeholder):
            if j <= t:
                keep_images += 1
                continue
            cut, dropped_at = min(i, t), i
            break
        if dropped_at == cut:  # drop a dangling opener (e.g. <|vision_start|>) before the dropped image
            specials = set(getattr(self.tokenizer, "all_special_ids", []) or [])
            while cut > 1 and row[cut - 1] in specials:
                cut -= 1
        out = {}
        for k, v in enc.items():
            if k in SEQ_KEYS:
                out[k] = v[:, :cut]
        n_images = sum(1 for _ in _runs(row, placeholder))
        if keep_images < n_images:
            if "image_grid_thw" in enc:
                grid = enc["image_grid_thw"][:keep_images]
                out["image_grid_thw"] = grid
                out["pixel_values"] = enc["pixel_values"][: int(grid.prod(-1).sum())]
            elif "pixel_values" in enc:
                out["pixel_values"] = enc["pixel_values"][:keep_images]
                if "image_sizes" in enc:
                    out["image_sizes"] = enc["image_sizes"][:keep_images]
            if keep_images == 0:
                for k in ("pixel_values", "image_grid_thw", "image_sizes"):
                    out.pop(k, None)
        else:
            for k, v in enc.items():
                out.setdefault(k, v)
        return out

    # ---------------------------------------------------------------- stream

    def __len__(self) -> int:
        return len(self.samples)

    def _order(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(len(self.samples), generator=g).tolist()
            self._perm_epoch = epoch
        return self._perm

    def sample(self, k: int) -> dict:
        """Sample number ``k`` of the stream: input_ids, attention_mask, labels, plus vision inputs."""
        n = len(self.samples)
        kind, idx = self.samples[self._order(k // n)[k % n]]
        rng = random.Random(f"{self.seed}/facts/{k}")
        answers = None
        if kind == "text" and self.facts is not None and rng.random() < self.facts.share:
            ids, answers = self._facts_sample(self.chunks[idx], rng)
            ids, answers = ids[None], answers[None]
            enc = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        elif kind == "text":
            ids = self.chunks[idx][None]
            enc = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        else:
            enc = self._render(self.conversations[idx], with_answers=self.answer_turns)
            answers = enc.pop("answer_mask", None)
            enc.setdefault("attention_mask", torch.ones_like(enc["input_ids"]))
        enc["labels"] = self._labels(enc["input_ids"])
        if self.facts is not None or self.answer_turns:  # every sample has the key, so batches collate
            enc["answer_mask"] = answers if answers is not None else torch.zeros_like(enc["labels"], dtype=torch.bool)
        return enc

    def _facts_sample(self, chunk: torch.Tensor, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
        """A chat of ``chunk``'s text with planted facts and their questions, at most max_length
        tokens, and the mask of label positions that predict an answer's tokens."""
        mix = self.facts
        state = rng.getstate()  # the same facts with an empty text: what the chat costs besides the text
        overhead = len(self._chat_ids(facts_chat("", rng, mix.per_sample, mix.kinds), add_generation_prompt=False))
        rng.setstate(state)
        room = self.max_length - overhead - ROOM_SLACK
        if room < 32:
            raise ValueError(f"max_length {self.max_length} leaves no room for a text with {mix.per_sample} "
                             f"planted facts and their questions ({overhead} tokens); raise max_length or lower "
                             "--facts-per-sample")
        doc = self.tokenizer.decode(chunk[:room], skip_special_tokens=True)
        messages = facts_chat(doc, rng, mix.per_sample, mix.kinds)
        ids = self._chat_ids(messages, add_generation_prompt=False)
        if len(ids) > self.max_length:  # fail closed: a cut chat would drop the answers it is for
            raise ValueError(f"a planted-fact chat took {len(ids)} tokens, over max_length {self.max_length}")
        answers = torch.zeros(len(ids), dtype=torch.bool)
        for turn in range(3, len(messages), 2):  # the answer turns (0: document, 1: acknowledgement)
            start = len(self._chat_ids(messages[:turn], add_generation_prompt=True))
            upto = self._chat_ids(messages[: turn + 1], add_generation_prompt=False)
            stop = len(upto)
            if not (0 < start < stop <= len(ids)) or not torch.equal(ids[:stop], upto):
                raise ValueError("the chat template does not render a chat as the concatenation of its turns; "
                                 "answer tokens cannot be located")
            answers[start - 1: stop - 1] = True  # label position t predicts token t + 1
        return ids, answers

    def _chat_ids(self, messages: list[dict], add_generation_prompt: bool) -> torch.Tensor:
        return self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                                  add_generation_prompt=add_generation_prompt)["input_ids"][0]

    def _labels(self, ids: torch.Tensor) -> torch.Tensor:
        """Next-token targets aligned with the inputs: labels[:, t] = ids[:, t+1]; the last
        position and image/video placeholder targets are ignored."""
        labels = torch.full_like(ids, IGNORE)
        labels[:, :-1] = ids[:, 1:]
        for x in (self.image_token_id, self.video_token_id):
            if x is not None:
                labels[labels == x] = IGNORE
        return labels

    def next_batch(self, batch_size: int, rank: int = 0, world: int = 1) -> dict:
        """The next ``batch_size`` samples for process ``rank`` of ``world``; advances the
        position by ``batch_size * world`` (every process keeps the same position)."""
        base = self.position
        picks = [self.sample(base + j * world + rank) for j in range(batch_size)]
        self.position = base + batch_size * world
        return collate(picks, pad_id=self.tokenizer.pad_token_id or 0)

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "num_samples": len(self.samples)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_samples") not in (None, len(self.samples)) or state.get("seed", self.seed) != self.seed:
            raise ValueError("checkpoint data position was saved for other data (sample count or seed differ)")
        self.position = int(state["position"])


def _runs(row: list[int], ids: set):
    i = 0
    while i < len(row):
        if row[i] in ids:
            j = i
            while j < len(row) and row[j] == row[i]:
                j += 1
            yield i, j
            i = j
        else:
            i += 1


SEQ_KEYS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "token_type_ids", "answer_mask")


def collate(samples: list[dict], pad_id: int = 0) -> dict:
    """Right-pad the sequence tensors and concatenate the vision tensors along dim 0."""
    if len(samples) == 1:
        return samples[0]
    t = max(s["input_ids"].shape[1] for s in samples)
    fill = {"input_ids": pad_id, "attention_mask": 0, "labels": IGNORE}
    out: dict = {}
    for k in samples[0]:
        vals = [s[k] for s in samples if k in s]
        if k in SEQ_KEYS:
            out[k] = torch.cat([torch.nn.functional.pad(v, (0, t - v.shape[1]), value=fill.get(k, 0)) for v in vals])
        else:
            out[k] = torch.cat(vals)
    return out
