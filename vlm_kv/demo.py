"""``vlm-kv demo``: SmolLM2 answers questions about a long text, full cache vs compressed cache."""

from __future__ import annotations

import os
import time

import torch
from transformers import DynamicCache

from vlm_kv.api import cache_kwarg, make_cache

TEXT_FILE = os.path.join(os.path.dirname(__file__), "data", "frankenstein_letter1.txt")
QUESTIONS = (
    "In which city was this letter written?",
    "Who is the letter addressed to?",
)


def _cache_bytes(cache) -> int:
    if hasattr(cache, "kv_bytes"):
        return cache.kv_bytes()["total"]
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@torch.no_grad()
def answer(model, tokenizer, document: str, question: str, cache, max_new_tokens: int) -> tuple[str, float]:
    messages = [{"role": "user", "content": f"{document}\n\nQuestion: {question} Answer in one short sentence."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    start = time.perf_counter()
    out = model.generate(**inputs, **{cache_kwarg(model): cache}, max_new_tokens=max_new_tokens, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    return " ".join(text.split()), time.perf_counter() - start


def run_demo(policy: str = "dbtrimkv", budget: float = 0.25, max_new_tokens: int = 48, gates: str | None = None,
             questions: tuple[str, ...] = QUESTIONS, loaded: tuple | None = None) -> int:
    """Print full-cache and compressed-cache answers side by side; ``loaded`` = (model, tokenizer)."""
    from vlm_kv.smollm2 import load_smollm2

    if loaded is None:
        print("Loading SmolLM2-135M-Instruct (fp32, CPU) ...", flush=True)
        loaded = load_smollm2()
    model, tokenizer = loaded
    with open(TEXT_FILE, encoding="utf-8") as fh:
        document = fh.read()
    n_tokens = len(tokenizer(document).input_ids)
    print(f"Document: {os.path.basename(TEXT_FILE)}, {n_tokens} tokens. Compressed cache: {policy} at budget {budget}.\n")
    width = 58
    print(f"{'full cache':<{width}} | {policy + ' @ ' + str(budget):<{width}}")
    print("-" * (2 * width + 3))
    for question in questions:
        full = DynamicCache(config=model.config)
        kwargs = {"gates": gates} if gates else {}
        small = make_cache(model, policy=policy, budget=budget, **kwargs)
        a_full, t_full = answer(model, tokenizer, document, question, full, max_new_tokens)
        a_small, t_small = answer(model, tokenizer, document, question, small, max_new_tokens)
        print(f"Q: {question}")
        left_lines, right_lines = _wrap(a_full, width), _wrap(a_small, width)
        rows = max(len(left_lines), len(right_lines))
        left_lines += [""] * (rows - len(left_lines))
        right_lines += [""] * (rows - len(right_lines))
        for left, right in zip(left_lines, right_lines):
            print(f"{left:<{width}} | {right:<{width}}")
        b_full, b_small = _cache_bytes(full), _cache_bytes(small)
        mem_l = f"KV {b_full / 2**20:.2f} MiB, {t_full:.1f} s"
        mem_r = f"KV {b_small / 2**20:.2f} MiB ({b_small / b_full:.0%} of full), {t_small:.1f} s"
        print(f"{mem_l:<{width}} | {mem_r:<{width}}\n")
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
