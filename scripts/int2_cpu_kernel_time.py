"""Time one call of the CPU tiered decode kernel (``vlm_kv.kernels.int2_cpu``) on a synthetic layer,
for the kernel source of one or more git revisions, in one process (paired).

    python scripts/int2_cpu_kernel_time.py --revs 57deb25,HEAD --threads 1

The layer is shaped like SmolLM2's at 8192 tokens and budget 0.1 with tiers (3 KV heads x 3 query
heads, head_dim 64; by default 400 FP entries and 500 INT2 windows of 8 slots per KV head, 5 % of
the slots holes). Prints, per revision, the fastest and the median call over ``--calls`` calls
and the largest difference from the first revision's output; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import time

import torch
from torch.utils.cpp_extension import load_inline

from vlm_kv.attention.backend import PackedWindows
from vlm_kv.kernels import int2_cpu
from vlm_kv.kernels.int2 import quantize_keys_compact, quantize_values


def kernel_source(rev: str) -> str:
    """The C++ source of ``kernels/int2_cpu.py`` at a git revision (``HEAD``, a commit)."""
    text = subprocess.run(["git", "show", f"{rev}:kernels/int2_cpu.py"], check=True, capture_output=True,
                          text=True).stdout
    scope: dict = {}
    start = text.index('_SOURCE = r"""')
    exec(text[start : text.index('"""', start + 14) + 3], scope)  # the one string literal, nothing else
    return scope["_SOURCE"]


def synthetic_layer(fp_entries: int, windows: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    heads, group, slots, tail, dim = 3, 3, 8, 8, 64
    n = windows * heads
    keys, values = torch.randn(n, slots, dim, generator=gen), torch.randn(n, slots, dim, generator=gen)
    vc, vs, vz = quantize_values(values)
    kc, kz, ks, ref = quantize_keys_compact(keys)
    holes = torch.rand(n, slots, generator=gen) < 0.05
    packed = PackedWindows(kc, ks, kz, ref, vc, vs, vz, torch.tensor([windows] * heads), holes)
    body = (torch.randn(fp_entries * heads, dim, generator=gen), torch.randn(fp_entries * heads, dim, generator=gen),
            torch.tensor([fp_entries] * heads))
    tail_kv = (torch.randn(heads, tail, dim, generator=gen), torch.randn(heads, tail, dim, generator=gen),
               torch.ones(tail, dtype=torch.bool))
    query = torch.randn(heads * group, dim, generator=gen)
    return query, body, tail_kv, packed, group


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--revs", default="HEAD", help="comma-separated git revisions")
    p.add_argument("--fp-entries", type=int, default=400, help="FP entries per KV head")
    p.add_argument("--windows", type=int, default=500, help="INT2 windows per KV head")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    query, body, tail, w, group = synthetic_layer(args.fp_entries, args.windows)
    flags = ["-O3", "-march=native", "-fopenmp"]
    rows, first = [], None
    for rev in args.revs.split(","):
        source = kernel_source(rev)
        name = "int2_cpu_time_" + hashlib.sha1(source.encode()).hexdigest()[:10] + "_" + int2_cpu._host_tag()
        module = load_inline(name=name, cpp_sources=[source], functions=["tiered_decode"], extra_cflags=flags,
                             extra_ldflags=["-fopenmp"])

        def call():
            return module.tiered_decode(query, query, *body, *tail, w.key_codes, w.key_scale, w.key_zero, w.key_ref,
                                        w.value_codes, w.value_scale, w.value_zero, w.head_windows, w.holes, group, 0.125)

        for _ in range(20):
            out = call()
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        first = out if first is None else first
        row = {"rev": rev, "min_us": min(times) * 1e6, "median_us": statistics.median(times) * 1e6,
               "max_abs_diff_vs_first": float((out - first).abs().max()), "threads": args.threads,
               "fp_entries": args.fp_entries, "windows": args.windows}
        rows.append(row)
        print(f"{rev:>12}: fastest {row['min_us']:7.0f} us, median {row['median_us']:7.0f} us, "
              f"max |diff| vs {args.revs.split(',')[0]} {row['max_abs_diff_vs_first']:.1e}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
