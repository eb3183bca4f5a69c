"""Gate training under a 2-process CPU launch equals one process with the same global batch."""

import json
import os
import subprocess
import sys

import torch

from vlm_kv.gates.io import load_gates
from vlm_kv.testing import tiny_model, tiny_processor

STEPS = 3


def _args(folder, text, out, batch_size):
    return ["train-gates", "--model", str(folder), "--data", str(text), "--budget-tokens", "16",
            "--max-length", "48", "--steps", str(STEPS), "--batch-size", str(batch_size), "--out", str(out),
            "--width", "8", "--init-bias", "4.0", "--lr", "3e-2", "--warmup", "0", "--global", "--no-progress",
            "--save-every", "100"]


def test_two_cpu_processes_train_the_same_gates_as_one(tmp_path):
    folder = tmp_path / "llama"
    tiny_model("llama").save_pretrained(folder)
    tiny_processor("llama").save_pretrained(folder)
    text = tmp_path / "book.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good "
                    "fortune, must be in want of a wife. However little known the feelings or views of such "
                    "a man may be on his first entering a neighbourhood, this truth is so well fixed. " * 8)
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1")  # accelerate: gloo across CPU processes
    env.pop("WORLD_SIZE", None)
    one = subprocess.run([sys.executable, "-m", "vlm_kv.cli.main", *_args(folder, text, tmp_path / "one", 2)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", "vlm_kv.cli.main", *_args(folder, text, tmp_path / "two", 1)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]

    m1 = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert len(m1) == len(m2) == STEPS  # one metrics writer (the main process)
    for a, b in zip(m1, m2):
        assert a["data_position"] == b["data_position"] == 2 * a["step"]  # the same global batches
        assert a["tokens"] == b["tokens"]
        for key in ("loss", "kl", "ce", "cap"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (key, a[key], b[key])
    g1 = load_gates(str(tmp_path / "one")).state_dict()
    g2 = load_gates(str(tmp_path / "two")).state_dict()
    assert g1.keys() == g2.keys()
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], rtol=1e-4, atol=1e-5)
    assert m1[0]["cap"] != m1[-1]["cap"]  # the gates did move (the comparison is not between two starts)
