"""Capacity term: O(T) scan vs the O(T^2) double sum, speed and agreement (prints figures).

    OMP_NUM_THREADS=1 python -m vlm_kv.train.bench_capacity --length 2048
"""

from __future__ import annotations

import argparse
import time

import torch

from vlm_kv.train.losses import capacity_loss, expected_live, expected_live_pairwise


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--heads", type=int, default=90, help="layers x KV heads, a multiple of 3 (SmolLM2: 30 x 3)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    t_len = args.length
    lb = torch.nn.functional.logsigmoid(torch.empty(args.heads, 1, t_len).uniform_(-4, 12, generator=g))
    rows = []
    for name, fn in (("pairwise O(T^2)", expected_live_pairwise), ("scan O(T)", expected_live)):
        x = lb.clone().requires_grad_()
        t0 = time.perf_counter()
        s = fn(x)
        t1 = time.perf_counter()
        s.sum().backward()
        rows.append((name, s.detach().double(), t1 - t0, time.perf_counter() - t1))
    exact = rows[0][1]
    for name, s, fwd, bwd in rows:
        rel = ((s - exact).abs() / exact).max().item()
        print(f"{name:>16}: forward {fwd:6.2f} s  backward {bwd:6.2f} s  max rel. error of S_t {rel:.1e}")
    lbs = [x[None] for x in lb[:, 0].reshape(-1, 3, t_len)]  # layers of 3 KV heads
    for f in (0.05, 0.1, 0.25):
        a = capacity_loss(lbs, f * t_len, True)[0].item()
        e = capacity_loss(lbs, f * t_len, True, exact=True)[0].item()
        print(f"global capacity loss at budget {f}: scan {a:.6f}  exact {e:.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
