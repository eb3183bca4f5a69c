"""Micro-benchmark of the decode attention backends: time per call and K/V bandwidth.

For each row length it builds one layer's paged store (blocks scattered through the pool) and,
with ``--int2-share``, a mixed store where that share of each row is INT2 windows; it times
every available backend (median of repeats, after warm-up), plus SDPA over a dense
[B, H, L, D] cache (what a DynamicCache layer runs), and reports the bytes of K/V the
call must read divided by its time, also as a fraction of the device's copy bandwidth
(``torch`` copy of a large tensor, counting bytes read plus bytes written).

    python -m vlm_kv.kernels.bench_kernels --device cuda --dtype bfloat16 --json docs/kernel_bench.jsonl
    python -m vlm_kv.kernels.bench_kernels --device cpu --lengths 512,2048,8192   # torch only

On CPU only the PyTorch backend runs (the Triton interpreter is a test tool, not a backend).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from vlm_kv.kernels.dispatch import resolve_backend
from vlm_kv.kernels.int2 import int2_window_bytes, quantize_keys, quantize_values
from vlm_kv.kernels.paged_torch import paged_decode_attention_torch
from vlm_kv.kernels.sources import Int2Source, PagedSource

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2,
              with_min: bool = False) -> float | tuple[float, float]:
    """Median seconds per call (and the fastest call, with ``with_min``: on a shared machine the
    minimum shows the code's cost, the median what a user would see)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return (statistics.median(times), min(times)) if with_min else statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes per second of ``dst.copy_(src)`` counting the read and the write."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() * src.element_size() / seconds


def build_store(rows: int, length: int, head_dim: int, block_size: int, dtype: torch.dtype, device: torch.device,
                seed: int = 0) -> PagedSource:
    """Every row holds ``length`` entries in blocks scattered through one pool."""
    gen = torch.Generator().manual_seed(seed)
    per_row = -(-length // block_size)
    num_blocks = max(1, rows * per_row)
    table = torch.randperm(num_blocks, generator=gen)[: rows * per_row].view(rows, per_row).to(torch.int32)
    return PagedSource(
        key_pool=torch.randn(num_blocks, block_size, head_dim, dtype=dtype, device=device),
        value_pool=torch.randn(num_blocks, block_size, head_dim, dtype=dtype, device=device),
        block_table=table.to(device),
        lengths=torch.full((rows,), length, dtype=torch.int32, device=device),
    )


def build_int2(rows: int, windows: int, window: int, head_dim: int, device: torch.device, seed: int = 1) -> Int2Source:
    """Every row holds ``windows`` INT2 windows scattered through one window pool (built on ``device``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    n = max(1, rows * windows)
    kc, ks, kz = quantize_keys(torch.randn(n, window, head_dim, generator=gen, device=device))
    vc, vs, vz = quantize_values(torch.randn(n, window, head_dim, generator=gen, device=device))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    table = order[: rows * windows].view(rows, windows).to(torch.int32).to(device)
    return Int2Source(kc, ks, kz, vc, vs, vz, table, torch.full((rows,), windows, dtype=torch.int32, device=device))


def available_backends(device: torch.device) -> dict[str, Callable]:
    """name -> decode function (query, sources, scaling, validate) of each backend that runs on ``device``."""
    backends: dict[str, Callable] = {"torch": paged_decode_attention_torch}
    if device.type == "cuda":
        try:
            resolve_backend("triton", device)
        except RuntimeError as exc:  # no triton: report torch alone, say why
            print(f"triton backend unavailable: {exc}", file=sys.stderr)
        else:
            # lazy: vlm_kv.kernels.paged_triton imports triton, which is optional
            from vlm_kv.kernels.paged_triton import paged_decode_attention_triton

            backends["triton"] = paged_decode_attention_triton
    return backends


@dataclass(frozen=True)
class Setting:
    """What every measurement of a run shares: its options, device, rows and the device's copy bandwidth."""

    args: argparse.Namespace
    device: torch.device
    rows: int
    copy_bw: float


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    rows = args.batch * args.kv_heads
    elt = torch.empty(0, dtype=dtype).element_size()
    copy_bw = copy_bandwidth(device, args.copy_mib << 20, args.repeats)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"copy bandwidth {copy_bw / 1e9:.1f} GB/s (read + write)")
    results = []
    backends = available_backends(device)
    setting = Setting(args, device, rows, copy_bw)
    for length in args.lengths:
        query = torch.randn(args.batch, args.kv_heads * args.group, args.head_dim, dtype=dtype, device=device)
        cases = []
        fp = build_store(rows, length, args.head_dim, args.block_size, dtype, device)
        cases.append(("fp", fp, None, rows * length * 2 * args.head_dim * elt))
        if args.int2_share > 0:
            windows = int(length * args.int2_share) // args.window
            fp_len = length - windows * args.window
            mixed_fp = build_store(rows, fp_len, args.head_dim, args.block_size, dtype, device, seed=2)
            int2 = build_int2(rows, windows, args.window, args.head_dim, device)
            nbytes = rows * (fp_len * 2 * args.head_dim * elt + windows * int2_window_bytes(args.window, args.head_dim))
            cases.append((f"mixed{args.int2_share:g}", mixed_fp, int2, nbytes))
        # What a DynamicCache layer runs at the same length: SDPA over contiguous [B, H, L, D].
        dense_k = torch.randn(args.batch, args.kv_heads, length, args.head_dim, dtype=dtype, device=device)
        dense_v = torch.randn_like(dense_k)
        q4 = query[:, :, None, :]
        seconds = time_call(lambda: F.scaled_dot_product_attention(q4, dense_k, dense_v, enable_gqa=args.group > 1),
                            device, args.repeats, with_min=True)
        results.append(_result("sdpa", "dense", length, setting, seconds, cases[0][3]))
        for kind, fp_store, int2_store, nbytes in cases:
            sources = [fp_store] if int2_store is None else [fp_store, int2_store]
            for name, decode in backends.items():
                fn = lambda: decode(query, sources, None, False)  # noqa: E731
                seconds = time_call(fn, device, args.repeats, with_min=True)
                results.append(_result(name, kind, length, setting, seconds, nbytes))
    return results


def _result(backend: str, store: str, length: int, setting: Setting, times: tuple[float, float], nbytes: int) -> dict:
    seconds, fastest = times
    args, copy_bw = setting.args, setting.copy_bw
    row = {"backend": backend, "store": store, "length": length, "rows": setting.rows, "group": args.group,
           "head_dim": args.head_dim, "dtype": args.dtype, "device": str(setting.device), "ms": seconds * 1e3,
           "ms_min": fastest * 1e3,
           "kv_bytes": nbytes, "gb_per_s": nbytes / seconds / 1e9, "copy_fraction": nbytes / seconds / copy_bw}
    print(f"{store:>9} {backend:>6} L={length:>6}: {seconds * 1e3:8.3f} ms (min {fastest * 1e3:8.3f})  "
          f"{row['gb_per_s']:8.1f} GB/s  "
          f"{row['copy_fraction']:.2f} of copy", flush=True)
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--lengths", default="1024,4096,16384,65536", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--int2-share", type=float, default=0.7, help="share of each row in INT2 for the mixed case (0: skip)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--copy-mib", type=int, default=1024, help="size of the tensor copied to measure bandwidth")
    parser.add_argument("--json", default=None, help="write one JSON object per line to this file")
    args = parser.parse_args(argv)
    if not 0 <= args.int2_share < 1:
        parser.error("--int2-share must be in [0, 1)")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    results = run(args)
    if args.json:
        with open(args.json, "w") as fh:
            for row in results:
                fh.write(json.dumps(row) + "\n")
    return results


if __name__ == "__main__":
    main()
