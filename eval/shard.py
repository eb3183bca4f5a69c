"""Sharded evaluation: each process answers a slice of the problems, the main process merges.

    accelerate launch --num_processes 4 -m vlm_kv.eval mathvision --model DIR --policy snapkv --budget 0.25
    vlm-kv eval mathvision ... --num-processes 2        # launches itself with torch.distributed.run

Process ``r`` of ``n`` takes items ``r, r + n, r + 2n, ...`` and writes them into
``OUT/shards/rank-r-of-n/`` with the single-process runner (so each shard is resumable on its
own); after a barrier the main process merges the shards into ``OUT`` in the original item
order: the same files a single-process run writes, with the same rows (generation is greedy
and each item runs on its own fresh cache, so the process that ran it does not matter; the
per-row wall-clock ``seconds`` differ, as they do between any two runs).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from accelerate import PartialState

from vlm_kv.eval import mathvision_run as mr
from vlm_kv.eval import mmdu_run as mm
from vlm_kv.eval.mathvision_run import run_mathvision

__all__ = ["Shard", "current_shard", "shard_dir", "launch", "run_mathvision_sharded", "generate_answers_sharded"]

SHARDS = "shards"


@dataclass
class Shard:
    """This process's place among the evaluation processes, with a barrier."""

    rank: int = 0
    world: int = 1
    _state: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def pick(self, items: Sequence) -> list:
        return list(items)[self.rank::self.world]

    def wait(self) -> None:
        if self._state is not None and self.world > 1:
            self._state.wait_for_everyone()

    @property
    def device(self) -> str | None:
        """The device of this process under a multi-process launch (None: the caller's default)."""
        if self._state is None or self.world == 1:
            return None
        return str(self._state.device)


def current_shard() -> Shard:
    """This process's shard; a single process (rank 0 of 1) unless started by a distributed
    launcher (``accelerate launch``, ``torch.distributed.run``)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Shard()

    state = PartialState(cpu=not torch.cuda.is_available())  # gloo on CPU-only machines
    return Shard(state.process_index, state.num_processes, state)


def shard_dir(out: str | os.PathLike, shard: Shard) -> Path:
    return Path(out) / SHARDS / f"rank-{shard.rank}-of-{shard.world}"


def launch(num_processes: int, module_args: list[str]) -> int:
    """Run ``python -m vlm_kv.eval <module_args>`` in ``num_processes`` processes and wait."""
    if num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {num_processes}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_processes}",
           "-m", "vlm_kv.eval", *module_args]
    return subprocess.run(cmd, check=False).returncode


# ----------------------------------------------------------------------------- MathVision


def run_mathvision_sharded(model, processor, problems, *, out_dir, shard: Shard, progress: bool = True,
                           config_extra: dict | None = None, **kwargs):
    """``run_mathvision`` on this process's slice; the main process merges and returns the
    summary of the whole run (the others return None)."""

    problems = list(problems)
    if kwargs.get("limit") is not None:
        problems = problems[: max(int(kwargs.pop("limit")), 0)]
    kwargs.pop("limit", None)
    run_mathvision(model, processor, shard.pick(problems), out_dir=shard_dir(out_dir, shard),
                   progress=progress and shard.is_main, config_extra=config_extra, **kwargs)
    shard.wait()
    summary = merge_mathvision(out_dir, problems, shard.world) if shard.is_main else None
    shard.wait()
    return summary


def merge_mathvision(out_dir, problems, world: int):
    """Merge ``world`` shard folders into ``out_dir`` (rows in problem order) and summarize."""

    out = Path(out_dir)
    folders = [shard_dir(out, Shard(r, world)) for r in range(world)]
    with open(folders[0] / mr.CONFIG_FILE, encoding="utf-8") as fh:
        config = json.load(fh)
    mr._check_config(out, config)
    latest: dict[str, dict] = {}
    for folder in folders:
        rows, _ = mr.load_rows(folder / mr.RESPONSES_FILE)
        for row in rows:
            latest[str(row["id"])] = row
    unique, repeated, seen = [], [], set()
    for p in problems:
        (repeated if p.id in seen else unique).append(p)
        seen.add(p.id)
    mr._rewrite(out / mr.RESPONSES_FILE, [latest[p.id] for p in unique if p.id in latest])
    return mr._summarize(out, unique, latest, len(latest), 0, config, repeated)


# ----------------------------------------------------------------------------- MMDU


def generate_answers_sharded(model, processor, data, out_dir, *, shard: Shard, progress: bool = True, **kwargs):
    """MMDU ``generate_answers`` on this process's dialogs; the main process merges the answers
    into ``out_dir`` (dialogs in data order) and returns the summed counts (others: None)."""

    mine = _subset(data, shard.pick(data.dialogs))
    counts = mm.generate_answers(model, processor, mine, shard_dir(out_dir, shard), progress=progress and shard.is_main,
                                 **kwargs)
    path = shard_dir(out_dir, shard) / "counts.json"
    path.write_text(json.dumps(counts), encoding="utf-8")
    shard.wait()
    merged = merge_mmdu(out_dir, data, shard.world) if shard.is_main else None
    shard.wait()
    return merged


def merge_mmdu(out_dir, data, world: int) -> dict[str, int]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    folders = [shard_dir(out, Shard(r, world)) for r in range(world)]
    with open(folders[0] / mm.CONFIG_FILE, encoding="utf-8") as fh:
        config = json.load(fh)
    config["data"] = data.path  # the shards ran on subsets of the same data
    mm._check_config(out, config)
    done: dict[str, list[dict]] = {}
    counts: dict[str, int] = {}
    for folder in folders:
        done.update(mm.load_finished(folder / mm.ANSWERS_FILE))
        for k, v in json.loads((folder / "counts.json").read_text(encoding="utf-8")).items():
            counts[k] = counts.get(k, 0) + int(v)
    ordered = {d.id: done[d.id] for d in data.dialogs if d.id in done}
    path = out / mm.ANSWERS_FILE
    path.write_text("", encoding="utf-8")
    mm._rewrite_compact(path, ordered)
    return counts


def _subset(data, dialogs):
    sub = copy.copy(data)
    sub.dialogs = list(dialogs)
    return sub
