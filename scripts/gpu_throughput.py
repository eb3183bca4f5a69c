"""Prefill and decode throughput of a 7B-class model with random weights: DynamicCache vs vlm_kv caches.

The model is Qwen2.5-VL-7B's language model (Qwen2 architecture: hidden 3584, 28 layers, 28 query
heads, 4 KV heads, intermediate 18944, vocab 152064), built from a config written here with random
bf16 weights, so nothing is downloaded. For every prompt length and batch it runs ``generate``
(greedy, a fixed number of new tokens) with a DynamicCache (SDPA) and with ``vlm_kv.make_cache`` at
``--budget``: snapkv, and a tiered cache (dbtrimkv + INT2 tiers when shipped gates fit the model,
else snapkv + INT2 tiers). One JSON line per run: prefill and decode tokens/s, the KV bytes the
cache holds at the end, and peak device memory (``torch.cuda.max_memory_allocated``; null on CPU).
A run that fails (out of memory) prints its error in its line and the others go on.

    python scripts/gpu_throughput.py --json runs/gpu_throughput.jsonl          # CUDA, bf16
    python scripts/gpu_throughput.py --tiny                                     # CPU smoke run, seconds

``--tiny`` swaps in a tiny Qwen2 config (2 layers, hidden 64) and a few short prompts, so the whole
path runs on CPU in a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class TextModel:
    """A Qwen2 language model's shape (written here: the script downloads nothing)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float
    max_positions: int


QWEN25_VL_7B_TEXT = TextModel("Qwen2.5-VL-7B text (Qwen2, random weights)", 3584, 28, 28, 4, 18944, 152064, 1e6, 65536)
TINY = TextModel("tiny Qwen2 (random weights)", 64, 2, 4, 2, 128, 512, 1e4, 4096)


@dataclass(frozen=True)
class Plan:
    """What to run: prompt lengths x batches, new tokens per run, the vlm_kv budget, device and dtype."""

    model: TextModel
    prompt_lengths: tuple[int, ...]
    batches: tuple[int, ...]
    new_tokens: int
    budget: float
    device: str
    dtype: torch.dtype
    seed: int = 0


@dataclass(frozen=True)
class CacheChoice:
    """A cache to measure: ``policy`` None is transformers' DynamicCache; else ``make_cache`` with ``options``."""

    label: str
    policy: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


def build_model(spec: TextModel, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A Qwen2ForCausalLM of ``spec`` with random weights, created directly on ``device`` (no host copy of 7B)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions, rope_theta=spec.rope_theta, rms_norm_eps=1e-6,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.eval()


def cache_choices(model: torch.nn.Module) -> list[CacheChoice]:
    """DynamicCache, snapkv, and the tiered cache this model supports (dbtrimkv needs gates that fit it)."""
    from vlm_kv.gates import default_gates_for
    from vlm_kv.models.adapters import get_adapter

    fits = default_gates_for(get_adapter(model).fingerprint(), "dbtrimkv")
    tiered = (CacheChoice("dbtrimkv+int2", "dbtrimkv", {"tiers": "int2"}) if fits
              else CacheChoice("snapkv+int2", "snapkv", {"tiers": "int2"}))
    return [CacheChoice("dynamic"), CacheChoice("snapkv", "snapkv"), tiered]


class _StepClock:
    """A stopping criterion that never stops: it records when each generated token is ready."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        _sync(self.device)
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def held_kv_bytes(cache: Any) -> int:
    """Key/value bytes a cache holds: ``kv_bytes()["total"]`` of a vlm_kv cache, the layers' tensors of a DynamicCache."""
    if hasattr(cache, "kv_bytes"):
        return int(cache.kv_bytes()["total"])
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor))


def _make(model: torch.nn.Module, choice: CacheChoice, budget: float) -> Any:
    from transformers import DynamicCache

    import vlm_kv

    if choice.policy is None:
        return DynamicCache(config=model.config)
    return vlm_kv.make_cache(model, policy=choice.policy, budget=budget, **choice.options)


def measure(model: torch.nn.Module, choice: CacheChoice, prompt_len: int, batch: int, plan: Plan) -> dict[str, Any]:
    """One greedy ``generate`` of ``plan.new_tokens`` tokens after a ``prompt_len`` prompt at ``batch``."""
    from vlm_kv.api import cache_kwarg

    device = torch.device(plan.device)
    row = {"model": plan.model.name, "cache": choice.label, "policy": choice.policy or "full", "budget":
           None if choice.policy is None else plan.budget, "tiers": choice.options.get("tiers"), "batch": batch,
           "prompt_tokens": prompt_len, "new_tokens": plan.new_tokens, "device": str(device),
           "dtype": str(plan.dtype).replace("torch.", "")}
    gen = torch.Generator().manual_seed(plan.seed + prompt_len + batch)
    ids = torch.randint(3, plan.model.vocab, (batch, prompt_len), generator=gen).to(device)
    clock = _StepClock(device)
    try:
        cache = _make(model, choice, plan.budget)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=plan.new_tokens,
                           min_new_tokens=plan.new_tokens, do_sample=False, stopping_criteria=[clock],
                           **{cache_kwarg(model): cache})
    except torch.cuda.OutOfMemoryError as exc:  # a too-large cell is a result too; the other cells still run
        row["error"] = f"OutOfMemoryError: {str(exc).splitlines()[0]}"
        return row
    # the first stamp is the first new token: the prefill plus one sampling step
    prefill_s = clock.stamps[0] - start
    decode_s = clock.stamps[-1] - clock.stamps[0]
    decoded = (len(clock.stamps) - 1) * batch
    row.update(
        prefill_s=round(prefill_s, 4), prefill_tokens_per_s=round(batch * prompt_len / prefill_s, 1),
        decode_s=round(decode_s, 4), decode_tokens_per_s=round(decoded / decode_s, 1) if decoded else None,
        kv_bytes=held_kv_bytes(cache),
        # windows held in INT2 at the end: shows the tiered cache did quantize at this budget
        int2_windows=cache.stats()["per_tier"]["int2_windows"] if choice.options.get("tiers") else None,
        peak_memory_bytes=int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None,
    )
    return row


def run(plan: Plan, emit: Any = print) -> list[dict[str, Any]]:
    """Every cache x prompt length x batch of ``plan``; each row is passed to ``emit`` as a JSON line."""
    model = build_model(plan.model, plan.dtype, plan.device)
    rows = []
    for prompt_len in plan.prompt_lengths:
        for batch in plan.batches:
            for choice in cache_choices(model):
                row = measure(model, choice, prompt_len, batch, plan)
                emit(json.dumps(row))
                rows.append(row)
    return rows


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_plan(argv: list[str] | None = None) -> tuple[Plan, str | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny Qwen2 on CPU, short prompts (a smoke run)")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --tiny)")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 (float32 with --tiny)")
    parser.add_argument("--lengths", default=None, help="prompt lengths, comma-separated (default 8192,32768)")
    parser.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated per run (default 64)")
    parser.add_argument("--budget", type=float, default=0.1, help="vlm_kv budget (fraction of the full cache)")
    parser.add_argument("--json", default=None, help="also write the JSON lines to this file")
    args = parser.parse_args(argv)

    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split(","))

    plan = Plan(
        model=TINY if args.tiny else QWEN25_VL_7B_TEXT,
        prompt_lengths=ints(args.lengths or ("512,640" if args.tiny else "8192,32768")),
        batches=ints(args.batches if not args.tiny or args.batches != "1,8" else "1,2"),
        new_tokens=args.new_tokens or (4 if args.tiny else 64),
        budget=args.budget,
        device=args.device or ("cpu" if args.tiny else "cuda"),
        dtype=DTYPES[args.dtype or ("float32" if args.tiny else "bfloat16")],
    )
    if plan.new_tokens < 2:
        parser.error("--new-tokens must be >= 2 (decode speed is measured after the first token)")
    return plan, args.json


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    import contextlib

    plan, path = parse_plan(argv)
    with open(path, "w") if path else contextlib.nullcontext() as sink:
        def emit(line: str) -> None:
            print(line, flush=True)
            if sink is not None:
                sink.write(line + "\n")
                sink.flush()

        return run(plan, emit)


if __name__ == "__main__":
    rows = main()
    sys.exit(1 if any("error" in row for row in rows) else 0)
