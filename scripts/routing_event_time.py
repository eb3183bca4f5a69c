"""Time the routing events of tiered decode on SmolLM2 (dbtrimkv + INT2 tiers).

    python scripts/routing_event_time.py --context 8192 --steps 64
    PYTHONPATH=/tmp/base_site python scripts/routing_event_time.py ...   # another commit, installed
                                                                        # with pip --no-deps --target

Prefills ``--context`` tokens of a held-out novel, then decodes ``--steps`` greedy tokens and times
every eviction step (one every ``evict_every`` tokens). Prints one JSON line: events, median and
fastest event in ms, ms per decoded token, the bytes held at the end and a digest of the generated
tokens (two commits that decide alike generate the same tokens and hold the same bytes).
"""

import argparse
import hashlib
import json
import time

import torch

from vlm_kv import make_cache
from vlm_kv.cli.bench import bench_tokens
from vlm_kv.models.named import load_model


def prompt_arguments(description: str) -> argparse.ArgumentParser:
    """The flags every routing timing script shares (``--context``, ``--budget``, ``--threads``, ``--text``)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--text", default="../shared/data/text/pg84.txt")
    return p


@torch.no_grad()
def prefilled(args: argparse.Namespace):
    """SmolLM2, ``context + 1`` tokens of the text, and a dbtrimkv + INT2 cache holding the first ``context``."""
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2")
    ids = bench_tokens(tokenizer, args.text, args.context + 1)
    cache = make_cache(model, policy="dbtrimkv", budget=args.budget, tiers="int2")
    model(input_ids=ids[:, : args.context], cache=cache, use_cache=True, logits_to_keep=1)
    return model, ids, cache


def main() -> None:
    p = prompt_arguments(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=64)
    args = p.parse_args()
    model, ids, cache = prefilled(args)
    seconds: list[float] = []
    generated: list[int] = []
    with torch.no_grad():
        evict = cache.evict

        def timed_evict() -> None:
            start = time.perf_counter()
            evict()
            seconds.append(time.perf_counter() - start)

        cache.evict = timed_evict
        token = ids[:, args.context : args.context + 1]
        start = time.perf_counter()
        for _ in range(args.steps):
            token = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            generated.append(int(token))
        total = time.perf_counter() - start
    ms = sorted(s * 1000 for s in seconds)
    print(json.dumps({
        "context": args.context, "steps": args.steps, "budget": args.budget, "threads": args.threads,
        "events": len(ms), "event_ms_median": round(ms[len(ms) // 2], 1) if ms else None,
        "event_ms_min": round(ms[0], 1) if ms else None, "ms_per_token": round(total / args.steps * 1000, 1),
        "kv_bytes": cache.kv_bytes()["total"],
        "tokens_sha1": hashlib.sha1(json.dumps(generated).encode()).hexdigest()[:12],
    }))


if __name__ == "__main__":
    main()
