"""scripts/gpu_throughput.py end to end: ``--tiny`` on CPU prints one JSON line per cache, prompt length and batch."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHES = ("dynamic", "snapkv", "snapkv+int2")  # no shipped gates fit the tiny config: snapkv + INT2 tiers
PROMPTS, BATCHES, NEW_TOKENS = (512, 640), (1, 2), 4
# the tiny Qwen2: 2 layers, 2 kv heads, head_dim 64 / 4 = 16, float32
LAYERS, KV_HEADS, HEAD_DIM, BYTES = 2, 2, 16, 4


def test_tiny_run_reports_every_cache_prompt_and_batch(tmp_path):
    out = tmp_path / "rows.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_throughput.py"), "--tiny", "--json", str(out)],
                          check=False, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows == [json.loads(line) for line in out.read_text().splitlines()]  # --json writes what it prints
    by_key = {(r["cache"], r["prompt_tokens"], r["batch"]): r for r in rows}
    assert len(rows) == len(by_key) == len(CACHES) * len(PROMPTS) * len(BATCHES)
    assert set(by_key) == {(c, p, b) for c in CACHES for p in PROMPTS for b in BATCHES}
    for (cache, prompt, batch), row in by_key.items():
        assert "error" not in row, row
        assert row["device"] == "cpu" and row["dtype"] == "float32" and row["new_tokens"] == NEW_TOKENS
        assert row["prefill_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0
        assert row["prefill_s"] > 0 and row["decode_s"] > 0
        assert row["peak_memory_bytes"] is None  # only measured on CUDA
        if cache == "dynamic":
            # every token but the last generated one (never fed back) is cached, keys and values
            seen = prompt + NEW_TOKENS - 1
            assert row["kv_bytes"] == LAYERS * 2 * batch * KV_HEADS * seen * HEAD_DIM * BYTES
            assert row["budget"] is None and row["policy"] == "full"
        else:
            assert row["budget"] == 0.1
            assert 0 < row["kv_bytes"] < by_key[("dynamic", prompt, batch)]["kv_bytes"] / 2
    tiered = [r for r in rows if r["tiers"] == "int2"]
    assert tiered and all(r["int2_windows"] > 0 for r in tiered)
