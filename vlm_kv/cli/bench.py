"""``vlm-kv bench``: prefill and decode speed, eviction share and memory, compressed caches vs DynamicCache.

For each (cache, context) one run prefills ``context`` tokens, then decodes ``steps`` tokens
``repeats`` times (greedy, eviction steps included) and reports the median ms per token.
Memory: the key/value bytes the cache held at its peak during prefill and during decode, and
the process's peak memory during the run (on CPU the kernel's resident high-water mark, reset
when the run starts, or the resident set sampled every 2 ms where it cannot be reset;
``torch.cuda.max_memory_allocated`` on CUDA).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from vlm_kv.api import cache_kwarg, make_cache
from vlm_kv.cache.report import cache_bytes
from vlm_kv.config import EMBEDDED_TEXT, CacheOptions
from vlm_kv.kernels import int2_cpu
from vlm_kv.storage.host_heap import return_freed_heap

DEFAULT_TEXT = EMBEDDED_TEXT


@dataclass
class BenchRow:
    policy: str            # "full" for DynamicCache
    budget: float | None
    context: int
    prefill_chunk: int | None
    prefill_s: float
    decode_ms_per_token: float
    tokens_per_s: float
    evict_share: float
    peak_kv_bytes_prefill: int
    peak_kv_bytes_decode: int
    peak_memory_bytes: int
    device: str
    dtype: str
    evict_every: int | None = None  # decode steps between the cache's eviction steps (None: DynamicCache)

    def as_dict(self) -> dict:
        return asdict(self)


class PeakMemory:
    """Peak process memory while the block runs: CUDA allocator peak, or resident set on CPU.

    On Linux the CPU peak is the kernel's own high-water mark (``VmHWM``), reset on entry through
    ``/proc/self/clear_refs``: exact, however short a spike. A 2 ms sampling thread, the fallback
    where that reset is refused, misses spikes shorter than its period and reads late when the
    cores are busy (process peaks of the same code moved by 10 % between runs here)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self.method = "cuda" if device.type == "cuda" else "sampled"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    @staticmethod
    def _high_water_mark() -> int | None:
        """The kernel's peak resident set of this process (``VmHWM``), or None where not readable."""
        try:
            with open("/proc/self/status") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    @staticmethod
    def _reset_high_water_mark() -> bool:
        """Start the kernel's peak resident set again from the current one (Linux >= 4.0)."""
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
        except OSError:
            return False
        return PeakMemory._high_water_mark() is not None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            self._stop.wait(0.002)

    @staticmethod
    def _release_freed_heap() -> None:
        """Return memory freed by earlier runs to the OS, so one run's peak does not start from
        the previous run's high-water mark (glibc keeps freed heap otherwise)."""
        gc.collect()
        return_freed_heap()

    def __enter__(self) -> "PeakMemory":
        self._release_freed_heap()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._reset_high_water_mark():
            self.method = "vmhwm"
        else:
            self.peak = self._rss()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
        elif self.method == "vmhwm":
            self.peak = max(self._high_water_mark() or 0, self._rss())
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self._rss())


def bench_tokens(tokenizer, text_path: str | None, count: int) -> torch.Tensor:
    """[1, count] token ids; a text shorter than that is read again from its start (timing only
    needs real-looking text, and the embedded default letter is 1.6k tokens)."""
    path = text_path or DEFAULT_TEXT
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if not text.strip():
        raise ValueError(f"text file {path} is empty")
    ids = tokenizer(text[: count * 12], return_tensors="pt", add_special_tokens=False).input_ids
    reps = -(-count // ids.shape[1])
    return ids.repeat(1, reps)[:, :count]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def run_one(model, ids: torch.Tensor, context: int, steps: int, repeats: int, factory: Callable,
            label: str, budget: float | None, prefill_chunk: int | None) -> BenchRow:
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    ids = ids.to(device)
    cache = factory()
    cache_arg = {cache_kwarg(model): cache}
    with PeakMemory(device) as memory:
        _sync(device)
        start = time.perf_counter()
        model(input_ids=ids[:, :context], **cache_arg, use_cache=True, logits_to_keep=1)
        _sync(device)
        prefill_s = time.perf_counter() - start
        peak_prefill = max(getattr(cache, "peak_kv_bytes", 0), cache_bytes(cache))
        if hasattr(cache, "peak_kv_bytes"):
            cache.peak_kv_bytes = 0  # from here on: the decode phase's own peak
        evict_before = getattr(cache, "evict_seconds", 0.0)
        token = ids[:, context : context + 1]
        per_round, decode_total = [], 0.0
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                logits = model(input_ids=token, **cache_arg, use_cache=True).logits
                token = logits[:, -1:].argmax(-1)
            _sync(device)
            elapsed = time.perf_counter() - start
            decode_total += elapsed
            per_round.append(elapsed * 1000 / steps)
    ms = statistics.median(per_round)
    evict_share = (getattr(cache, "evict_seconds", 0.0) - evict_before) / decode_total if decode_total else 0.0
    peak_decode = max(getattr(cache, "peak_kv_bytes", 0), cache_bytes(cache))
    return BenchRow(
        policy=label, budget=budget, context=context, prefill_chunk=prefill_chunk, prefill_s=prefill_s,
        decode_ms_per_token=ms, tokens_per_s=1000.0 / ms, evict_share=evict_share,
        peak_kv_bytes_prefill=int(peak_prefill), peak_kv_bytes_decode=int(peak_decode),
        peak_memory_bytes=int(memory.peak), device=device.type, dtype=str(dtype).replace("torch.", ""),
        evict_every=getattr(cache, "evict_every", None),
    )


def planned_runs(contexts: list[int], policies: list[str], budgets: list[float]) -> list[tuple[int, str, float | None]]:
    """(context, policy, budget) of every run, DynamicCache ("full", budget None) first at each context."""
    runs = []
    for context in contexts:
        runs.append((context, "full", None))
        runs += [(context, policy, budget) for policy in policies for budget in budgets]
    return runs


def warm_up(model) -> None:
    """One short forward, so that one-time costs (lazy kernel set-up, the first build of the CPU
    tiered-decode kernel) land in no run's timing."""
    device = next(model.parameters()).device
    if device.type == "cpu":
        try:
            int2_cpu.load()
        except int2_cpu.CpuKernelUnavailable:
            pass  # tiered runs keep the PyTorch path and say so when they start
    with torch.no_grad():
        model(input_ids=torch.ones(1, 16, dtype=torch.long, device=device), use_cache=False)


def _with_progress(runs: list[tuple[int, str, float | None]], progress: bool) -> Iterator[tuple[int, str, float | None]]:
    """The runs, under a progress bar naming the one in flight."""

    bar = tqdm(runs, desc="bench", disable=not progress, leave=False)
    for run in bar:
        bar.set_postfix_str(f"{run[1]}@{run[2] if run[2] is not None else 1} ctx {run[0]}")
        yield run


@dataclass(frozen=True)
class BenchPlan:
    """What one ``vlm-kv bench`` measures: every (policy, budget) and DynamicCache at every context.

    ``repeats``: decode passes per run (median taken), or rounds of ``bench_interleaved``.
    ``strategy``: polykv's strategy JSON (default: the one shipped for the model). ``tiers``:
    ``make_cache``'s ``tiers=`` for every compressed cache ("int2" or a dict of TierConfig fields).
    Plain values only, so a plan travels to ``bench_worker`` as JSON."""

    contexts: tuple[int, ...]
    policies: tuple[str, ...]
    budgets: tuple[float, ...]
    text_path: str | None = None
    steps: int = 32
    repeats: int = 3
    prefill_chunk: int | None = None
    strategy: str | None = None
    tiers: str | dict | None = None
    layerwise_prefill: bool = True
    evict_every: int | None = None

    def options(self) -> CacheOptions:
        return CacheOptions(prefill_chunk=self.prefill_chunk, layerwise_prefill=self.layerwise_prefill,
                            evict_every=self.evict_every)

    def runs(self) -> list[tuple[int, str, float | None]]:
        return planned_runs(list(self.contexts), list(self.policies), list(self.budgets))

    def make(self, model, policy: str, budget: float | None):
        """The cache of one run (a DynamicCache for ``"full"``)."""
        if policy == "full":
            return DynamicCache(config=model.config)
        strategy = self.strategy if policy == "polykv" else None
        return make_cache(model, policy=policy, budget=budget, tiers=self.tiers, strategy=strategy,
                          options=self.options())


def run_planned(model, ids: torch.Tensor, run: tuple[int, str, float | None], plan: BenchPlan,
                repeats: int) -> BenchRow:
    context, policy, budget = run
    chunk = None if policy == "full" else plan.prefill_chunk
    return run_one(model, ids, context, plan.steps, repeats, lambda: plan.make(model, policy, budget), policy,
                   budget, chunk)


def bench(model, tokenizer, plan: BenchPlan, progress: bool = True) -> Iterator[BenchRow]:
    """DynamicCache and every (policy, budget) at every context, in this process; yields one row
    per run. Peak memory of a run here includes what earlier runs left in the allocator:
    ``bench_isolated`` avoids that."""
    ids = bench_tokens(tokenizer, plan.text_path, max(plan.contexts) + 1)
    warm_up(model)
    for run in _with_progress(plan.runs(), progress):
        yield run_planned(model, ids, run, plan, plan.repeats)


def bench_interleaved(model, tokenizer, plan: BenchPlan, progress: bool = True) -> Iterator[BenchRow]:
    """Paired timing: at each context, every cache (DynamicCache included) runs once per round
    (``plan.repeats`` rounds of a fresh prefill, then ``steps`` decode steps), the order rotating
    between rounds; a row per cache reports the medians over rounds. Drift of a shared machine
    (other jobs, clock changes) then lands on every cache alike instead of on whichever ran during
    it: separate runs moved by up to 38 % here, a 15 % bound needs better. Peak memory is the
    process's, as in ``bench``."""
    ids = bench_tokens(tokenizer, plan.text_path, max(plan.contexts) + 1)
    warm_up(model)
    runs = plan.runs()
    rounds = plan.repeats
    bar = _progress_bar(len(runs) * rounds, progress)
    for context in plan.contexts:
        here = [run for run in runs if run[0] == context]
        measured: dict[tuple, list[BenchRow]] = {run: [] for run in here}
        for r in range(rounds):
            for run in here[r % len(here):] + here[: r % len(here)]:
                bar.set_postfix_str(f"round {r + 1}: {run[1]}@{run[2] if run[2] is not None else 1} ctx {context}")
                measured[run].append(run_planned(model, ids, run, plan, 1))
                bar.update()
        for run in here:
            yield median_row(measured[run])
    bar.close()


def median_row(rows: list[BenchRow]) -> BenchRow:
    """One row from repeated runs of the same cache: medians of the timings, maxima of the peaks."""
    med = lambda key: statistics.median(getattr(r, key) for r in rows)  # noqa: E731
    ms = med("decode_ms_per_token")
    return BenchRow(
        policy=rows[0].policy, budget=rows[0].budget, context=rows[0].context, prefill_chunk=rows[0].prefill_chunk,
        prefill_s=med("prefill_s"), decode_ms_per_token=ms, tokens_per_s=1000.0 / ms, evict_share=med("evict_share"),
        peak_kv_bytes_prefill=max(r.peak_kv_bytes_prefill for r in rows),
        peak_kv_bytes_decode=max(r.peak_kv_bytes_decode for r in rows),
        peak_memory_bytes=max(r.peak_memory_bytes for r in rows), device=rows[0].device, dtype=rows[0].dtype,
        evict_every=rows[0].evict_every,
    )


def _progress_bar(total: int, progress: bool):
    return tqdm(total=total, desc="bench", disable=not progress, leave=False)


def bench_isolated(model_name: str, dtype: str, device: str, plan: BenchPlan,
                   progress: bool = True) -> Iterator[BenchRow]:
    """``bench`` with every run in a fresh Python process (``python -m vlm_kv.cli.bench_worker``), as a
    user's process would run it: glibc keeps freed heap, so in one process a run's peak memory
    depends on what ran before it (measured: +-150 MiB between identical runs at 2048 tokens)."""

    for run in _with_progress(plan.runs(), progress):
        spec = dict(model=model_name, dtype=dtype, device=device, run=list(run), plan=asdict(plan))
        done = subprocess.run([sys.executable, "-m", "vlm_kv.cli.bench_worker", json.dumps(spec)],
                              capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"bench run {run} failed in its own process (exit {done.returncode}):\n"
                               + done.stderr[-2000:])
        yield BenchRow(**json.loads(lines[-1]))


def plot_rows(rows: list[BenchRow], path: str) -> None:
    """Decode tokens/s and peak prefill KV against context, one line per cache."""
    # lazy: matplotlib is optional (the eval extra)
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib is optional (the eval extra)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = sorted({(r.policy, r.budget) for r in rows}, key=lambda x: (x[0] != "full", x[0], x[1] or 0))
    for policy, budget in labels:
        mine = sorted((r for r in rows if (r.policy, r.budget) == (policy, budget)), key=lambda r: r.context)
        name = "DynamicCache" if policy == "full" else f"{policy} @ {budget}"
        axes[0].plot([r.context for r in mine], [r.tokens_per_s for r in mine], marker="o", label=name)
        axes[1].plot([r.context for r in mine], [r.peak_kv_bytes_prefill / 2**20 for r in mine], marker="o", label=name)
    axes[0].set(xlabel="context (tokens)", ylabel="decode tokens / s", title="decode speed")
    axes[1].set(xlabel="context (tokens)", ylabel="MiB", title="peak KV bytes during prefill")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
