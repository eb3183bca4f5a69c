"""``vlm-kv demo``: SmolLM2 answers questions about a long text, full cache vs compressed cache."""

from __future__ import annotations

import os
import time

import torch
from transformers import DynamicCache

from vlm_kv.api import cache_kwarg, make_cache
from vlm_kv.cache.report import cache_bytes
from vlm_kv.config import EMBEDDED_TEXT
from vlm_kv.models.smollm2 import load_smollm2

TEXT_FILE = EMBEDDED_TEXT
QUESTIONS = (
    "In which city was this letter written?",
    "Who is the letter addressed to?",
)


def _turn_ids(tokenizer, history: torch.Tensor | None, question: str, document: str | None) -> torch.Tensor:
    """Token ids of the conversation so far plus a new user turn (the document goes in the first)."""
    content = f"{document}\n\nQuestion: {question} Answer in one short sentence." if document else \
        f"{question} Answer in one short sentence."
    if history is None:
        messages = [{"role": "user", "content": content}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    # a new turn appended to the tokens the cache has seen (not a re-rendered template, whose
    # tokens could differ from what was generated)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prefix = history if int(history[0, -1]) == end else torch.cat([history, torch.tensor([[end]])], dim=1)
    turn = tokenizer(f"\n<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n", return_tensors="pt",
                     add_special_tokens=False).input_ids
    return torch.cat([prefix, turn], dim=1)


@torch.no_grad()
def conversation(model, tokenizer, document: str, questions: tuple[str, ...], cache, max_new_tokens: int) -> list[tuple[str, float]]:
    """Ask the questions as successive turns of one conversation on one cache; (answer, seconds) each."""
    history, answers = None, []
    for i, question in enumerate(questions):
        ids = _turn_ids(tokenizer, history, question, document if i == 0 else None)
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **{cache_kwarg(model): cache},
                             max_new_tokens=max_new_tokens, do_sample=False)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        answers.append((" ".join(text.split()), time.perf_counter() - start))
        history = out
    return answers


def run_demo(policy: str = "dbtrimkv", budget: float = 0.25, max_new_tokens: int = 48, gates: str | None = None,
             questions: tuple[str, ...] = QUESTIONS, loaded: tuple | None = None, strategy: str | None = None) -> int:
    """Print full-cache and compressed-cache answers side by side; the questions are successive
    turns of one conversation, each new turn prefilled on top of the (compressed) cache.
    ``loaded`` = (model, tokenizer)."""

    if loaded is None:
        print("Loading SmolLM2-135M-Instruct (fp32, CPU) ...", flush=True)
        loaded = load_smollm2()
    model, tokenizer = loaded
    with open(TEXT_FILE, encoding="utf-8") as fh:
        document = fh.read()
    n_tokens = len(tokenizer(document).input_ids)
    print(f"Document: {os.path.basename(TEXT_FILE)}, {n_tokens} tokens. Compressed cache: {policy} at budget {budget}.")
    print(f"The {len(questions)} questions are turns of one conversation on one cache.\n")
    width = 58
    full = DynamicCache(config=model.config)
    kwargs = {"gates": gates} if gates else {}
    if strategy:
        kwargs["strategy"] = strategy
    small = make_cache(model, policy=policy, budget=budget, **kwargs)
    full_answers = conversation(model, tokenizer, document, questions, full, max_new_tokens)
    small_answers = conversation(model, tokenizer, document, questions, small, max_new_tokens)
    print(f"{'full cache':<{width}} | {policy + ' @ ' + str(budget):<{width}}")
    print("-" * (2 * width + 3))
    for question, (a_full, t_full), (a_small, t_small) in zip(questions, full_answers, small_answers):
        print(f"Q: {question}")
        left_lines, right_lines = _wrap(a_full, width), _wrap(a_small, width)
        rows = max(len(left_lines), len(right_lines))
        left_lines += [""] * (rows - len(left_lines))
        right_lines += [""] * (rows - len(right_lines))
        for left, right in zip(left_lines, right_lines):
            print(f"{left:<{width}} | {right:<{width}}")
        print(f"{f'{t_full:.1f} s':<{width}} | {f'{t_small:.1f} s':<{width}}\n")
    b_full, b_small = cache_bytes(full), cache_bytes(small)
    mem_l = f"KV {b_full / 2**20:.2f} MiB after both turns"
    mem_r = f"KV {b_small / 2**20:.2f} MiB ({b_small / b_full:.0%} of full)"
    print(f"{mem_l:<{width}} | {mem_r:<{width}}")
    return 0


def _wrap(text: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + len(word) + 1 > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return lines + [line]
