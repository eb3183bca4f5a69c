"""Questions about the synthetic scenes (``visual_tasks``) put to smollava as a chat: the text of a
conversation, its tokens with answer-only labels, and greedy answers turn by turn on one cache.
Training (``vlm_kv.train.vlm_train``) and the multimodal benchmark share these."""

from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache

from vlm_kv.eval.visual_tasks import IMAGE_MARK, Item, answer_matches, make_item
from vlm_kv.models.smollava import (
    IMAGE_TOKEN,
    IMAGE_TOKENS,
    SYSTEM_PROMPT,
    pixel_values,
)

IGNORE = -100  # label of tokens outside an answer (the cross-entropy ignore index)


def _user_text(item: Item, turn: int) -> str:
    question = item.questions[turn].text
    return (item.preamble + question) if turn == 0 else question


def conversation_pieces(item: Item, answers: list[str] | None = None, turns: int | None = None) -> list[tuple[str, bool]]:
    """The chat text of ``item`` as (piece, is_answer) pairs, mirroring smollava's chat template.

    Turn ``k`` is the user's question (the captioned images come before the first) and, when
    ``answers`` has an entry for it, the assistant's answer; the last turn without an answer
    ends with the generation prompt. Images are ``IMAGE_TOKEN`` (expanded when tokenized).
    """
    turns = len(item.questions) if turns is None else turns
    answers = answers or []
    pieces = [(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n", False)]
    for k in range(turns):
        user = _user_text(item, k).replace(IMAGE_MARK, IMAGE_TOKEN)
        pieces.append((f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n", False))
        if k < len(answers):
            pieces.append((f"{answers[k]}<|im_end|>", True))
            pieces.append(("\n", False))
    return pieces


def encode_pieces(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Token ids (each image token expanded to its 196 positions) and labels (answers only)."""
    ids: list[int] = []
    labels: list[int] = []
    for text, is_answer in pieces:
        piece = tokenizer.encode(text.replace(IMAGE_TOKEN, IMAGE_TOKEN * IMAGE_TOKENS), add_special_tokens=False)
        ids += piece
        labels += piece if is_answer else [IGNORE] * len(piece)
    return ids, labels


@torch.no_grad()
def answer(model, tokenizer, item: Item, max_new_tokens: int = 8, cache=None, **generate_kwargs) -> list[str]:
    """Greedy answers to every question of ``item``, turn by turn on one cache, as a chat runs:
    each turn's prompt is appended to the tokens the model has seen and written so far, so
    turn k prefills only its own question on top of the (possibly compressed) cache.
    ``generate_kwargs`` go to every turn's ``generate`` (e.g. a logits processor that inspects the
    cache when a turn's first answer token is predicted)."""

    cache = DynamicCache() if cache is None else cache
    device = next(model.parameters()).device
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    history = torch.tensor([encode_pieces(tokenizer, conversation_pieces(item, [], 1))[0]], device=device)
    answers: list[str] = []
    for k, question in enumerate(item.questions):
        kwargs = {}
        if k == 0:
            kwargs["pixel_values"] = pixel_values(item.images).to(device, next(model.parameters()).dtype)
        else:
            closed = history[0, -1].item() == end_id
            turn = ("" if closed else "<|im_end|>") + f"\n<|im_start|>user\n{question.text}<|im_end|>\n<|im_start|>assistant\n"
            more = torch.tensor([tokenizer.encode(turn, add_special_tokens=False)], device=device)
            history = torch.cat([history, more], dim=1)
        out = model.generate(input_ids=history, attention_mask=torch.ones_like(history), past_key_values=cache,
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=end_id,
                             pad_token_id=tokenizer.pad_token_id, **kwargs, **generate_kwargs)
        answers.append(tokenizer.decode(out[0, history.shape[1]:], skip_special_tokens=True).strip())
        history = out
    return answers


def evaluate(model, tokenizer, task: str, seed: int, count: int, **item_kwargs) -> dict:
    """Exact-match accuracy of greedy answers over ``count`` items, per question kind."""
    hits: dict[str, list[bool]] = {}
    for i in range(count):
        item = make_item(task, seed, i, **item_kwargs)
        for q, a in zip(item.questions, answer(model, tokenizer, item)):
            hits.setdefault(q.kind, []).append(answer_matches(a, q.answer))
    every = [h for v in hits.values() for h in v]
    return {"task": task, "accuracy": float(np.mean(every)), "questions": len(every),
            "by_kind": {k: float(np.mean(v)) for k, v in sorted(hits.items())}}
