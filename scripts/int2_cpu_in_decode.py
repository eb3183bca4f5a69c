"""The CPU tiered decode kernel's time inside real decode steps, for the kernel sources of several
git revisions taking turns on one cache (so every source sees the same states).

    python scripts/int2_cpu_in_decode.py --revs 57deb25,HEAD --context 8192 --rounds 4 --steps 16

SmolLM2, dbtrimkv + tiers at ``--budget`` (fp32, one thread unless ``--threads``), the bench's text.
After the prefill, each round decodes ``--steps`` tokens with each revision's kernel in turn;
every call of ``vlm_kv.kernels.int2_cpu.tiered_decode`` is timed. Prints, per revision, the
kernel's milliseconds per decoded token and the whole step's (median over rounds); ``--json``
writes them. Where ``scripts/int2_cpu_kernel_time.py`` times the kernel on a layer in cache, this
reads it where the model's weights go through the cache between layers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

import vlm_kv
from vlm_kv.cli.bench import bench_tokens
from vlm_kv.kernels import int2_cpu
from vlm_kv.models.named import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int2_cpu_kernel_time import kernel_source  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--revs", default="HEAD")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    modules = {}
    for rev in args.revs.split(","):
        source = kernel_source(rev)
        name = "int2_cpu_in_decode_" + hashlib.sha1(source.encode()).hexdigest()[:10] + "_" + int2_cpu._host_tag()
        modules[rev] = load_inline(name=name, cpp_sources=[source], functions=["tiered_decode"],
                                   extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    model, tokenizer = load_model("smollm2")
    ids = bench_tokens(tokenizer, None, args.context + 1)
    cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=args.budget, tiers="int2")
    spent = [0.0]
    current = {"module": None}

    def timed_load(scalar: bool = False):
        return current["module"]

    original_load = int2_cpu.load
    int2_cpu.load = timed_load
    real_call = int2_cpu.tiered_decode

    def timed_call(*a, **k):
        start = time.perf_counter()
        out = real_call(*a, **k)
        spent[0] += time.perf_counter() - start
        return out

    int2_cpu.tiered_decode = timed_call
    kernel_ms = {rev: [] for rev in modules}
    step_ms = {rev: [] for rev in modules}
    with torch.no_grad():
        current["module"] = modules[next(iter(modules))]
        model(input_ids=ids[:, : args.context], past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = ids[:, args.context :]
        for _ in range(args.rounds):
            for rev, module in modules.items():
                current["module"] = module
                spent[0] = 0.0
                start = time.perf_counter()
                for _ in range(args.steps):
                    token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                step_ms[rev].append((time.perf_counter() - start) * 1000 / args.steps)
                kernel_ms[rev].append(spent[0] * 1000 / args.steps)
    int2_cpu.load = original_load
    rows = []
    for rev in modules:
        row = {"rev": rev, "context": args.context, "budget": args.budget, "threads": args.threads,
               "kernel_ms_per_token": statistics.median(kernel_ms[rev]), "step_ms_per_token": statistics.median(step_ms[rev]),
               "kernel_ms_rounds": kernel_ms[rev], "step_ms_rounds": step_ms[rev]}
        rows.append(row)
        print(f"{rev:>12}: kernel {row['kernel_ms_per_token']:.1f} ms a token, whole step "
              f"{row['step_ms_per_token']:.1f} ms (median of {args.rounds} rounds of {args.steps})", flush=True)
    if args.json:
        Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
