"""Markdown table (and ratios against DynamicCache of the same file) from `vlm-kv bench --json` files.

    python scripts/bench_table.py docs/bench/cpu_unchunked.jsonl docs/bench/cpu_chunked1024.jsonl

Rows repeated for the same (cache, context, chunk) (interleaved repeats) are reported by their
median, with the number of runs.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def load(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def table(rows: list[dict]) -> list[str]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["context"], r["policy"] != "full", r["policy"], r["budget"], r["prefill_chunk"])].append(r)
    full = {key[0]: runs for key, runs in groups.items() if key[2] == "full"}
    med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
    out = ["| cache | context | prefill chunk | runs | prefill s | x full | decode ms/token | full / this | evict share "
           "| peak KV prefill MiB | peak KV decode MiB | peak memory MiB | x full |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key in sorted(groups):
        context, _, policy, budget, chunk = key
        runs, ref = groups[key], full.get(context)
        name = "DynamicCache" if policy == "full" else f"{policy} @ {budget}"
        prefill, decode, memory = med(runs, "prefill_s"), med(runs, "decode_ms_per_token"), med(runs, "peak_memory_bytes")
        ratio = lambda mine, k, inverse=False: (f"{(med(ref, k) / mine if inverse else mine / med(ref, k)):.2f}"  # noqa: E731
                                               if ref and policy != "full" else "")
        out.append(f"| {name} | {context} | {chunk or ''} | {len(runs)} | {prefill:.2f} | {ratio(prefill, 'prefill_s')} "
                   f"| {decode:.1f} | {ratio(decode, 'decode_ms_per_token', True)} | {med(runs, 'evict_share'):.1%} "
                   f"| {med(runs, 'peak_kv_bytes_prefill') / 2**20:.0f} | {med(runs, 'peak_kv_bytes_decode') / 2**20:.0f} "
                   f"| {memory / 2**20:.0f} | {ratio(memory, 'peak_memory_bytes')} |")
    return out


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(f"\n{path}\n")
        print("\n".join(table(load(path))))
