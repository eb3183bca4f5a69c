"""Quality on the real SmolLM2-135M-Instruct: the one model whose numbers mean something."""
import json

import pytest

from vlm_kv.cli.main import main
from vlm_kv.config import CacheOptions
from vlm_kv.eval.fidelity import fidelity


@pytest.fixture(scope="module")
def short_runs(smollm2, shared_data):
    model, tok = smollm2
    runs = [("snapkv", 1.0), ("snapkv", 0.25), ("random", 0.25), ("streaming_llm", 0.25), ("dbtrimkv", 0.25)]
    results = fidelity(model, tok, str(shared_data / "text" / "pg84.txt"), context=384, continuation=24,
                       runs=runs, offset=100000)
    return {(r.policy, r.budget): r for r in results}


def test_kl_per_block_and_tier_moves_of_a_long_continuation(smollm2, shared_data, monkeypatch):
    from vlm_kv.eval import fidelity as F

    assert F.KL_BLOCK == 128
    monkeypatch.setattr(F, "KL_BLOCK", 16)  # 40 fed tokens: blocks of 16, 16 and 8
    model, tok = smollm2
    (tiered,) = fidelity(model, tok, str(shared_data / "text" / "pg84.txt"), context=256, continuation=40,
                         runs=[("qevict", 0.25)], offset=100000, options=CacheOptions(evict_every=8))
    blocks = tiered.kl_per_block
    assert len(blocks) == 3 and (16 * blocks[0] + 16 * blocks[1] + 8 * blocks[2]) / 40 == pytest.approx(tiered.kl)
    moves = tiered.tier_moves
    assert moves["quantized"] > 0 and moves["demotions"] > 0 and moves["promotions"] >= 0
    assert set(moves) >= {"quantized", "demotions", "promotions", "evicted_windows"}


def test_full_budget_reproduces_the_full_cache(short_runs):
    r = short_runs[("snapkv", 1.0)]
    assert r.kl < 1e-6 and r.top1 == 1.0
    assert abs(r.nll - r.full_nll) < 1e-4


def test_compression_holds_its_budget_and_attention_beats_random(short_runs):
    snap, rand, stream = short_runs[("snapkv", 0.25)], short_runs[("random", 0.25)], short_runs[("streaming_llm", 0.25)]
    for r in (snap, rand, stream):
        assert r.max_kv_bytes <= 0.25 * r.full_kv_bytes
        assert r.kv_bytes < 0.35 * r.full_kv_bytes
        assert r.kl > 0
    assert snap.kl < rand.kl
    assert snap.top1 >= rand.top1


def test_shipped_gates_drive_dbtrimkv_by_default(short_runs):
    import os

    from vlm_kv.gates import PRETRAINED_DIR

    gated, rand = short_runs[("dbtrimkv", 0.25)], short_runs[("random", 0.25)]
    assert gated.max_kv_bytes <= 0.25 * gated.full_kv_bytes
    assert gated.kl < rand.kl / 5
    # Every shipped set stays small (a few MB each, fp16), and the folder holds nothing else.
    from vlm_kv.gates import SHIPPED

    assert sorted(os.listdir(PRETRAINED_DIR)) == sorted(SHIPPED)
    for folder in SHIPPED:
        path = os.path.join(PRETRAINED_DIR, folder)
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        assert size <= 3 * 10**6, folder


def test_demo_prints_both_answers_and_memory(smollm2, capsys):
    from vlm_kv.cli.demo import run_demo

    questions = ("To whom are the letters addressed?", "Where is the writer going?")
    assert run_demo(budget=0.25, max_new_tokens=6, questions=questions, loaded=smollm2) == 0
    out = capsys.readouterr().out
    assert "full cache" in out and "dbtrimkv @ 0.25" in out
    assert all(f"Q: {q}" in out for q in questions)  # the second question is a second turn on the same cache
    assert out.count("KV ") == 2 and "of full" in out


def test_fidelity_cli_prints_one_json_line(shared_data, capsys, smollm2, monkeypatch):
    import vlm_kv.cli.main as cli

    monkeypatch.setattr(cli, "_load", lambda *args, **kwargs: smollm2)
    code = main(["fidelity", "--model", "smollm2", "--text", str(shared_data / "text" / "pg84.txt"),
                 "--offset", "5000", "--context", "128", "--continuation", "8", "--policy", "tova",
                 "--budget", "0.5", "--json"])
    assert code == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    row = json.loads(line)
    assert set(row) == {"policy", "budget", "context", "continuation", "kl", "top1", "nll", "kv_bytes",
                        "full_kv_bytes", "max_kv_bytes", "prefill_chunk", "dtype", "tiers", "int2_share", "int2_value",
                        "window", "key_rope", "fp_unit", "key_grid", "basis", "held_bytes", "kl_per_block",
                        "tier_moves"}
    assert row["tier_moves"] is None and len(row["kl_per_block"]) == 1
    assert row["tiers"] is None  # no --tiers: an untiered cache
    assert row["held_bytes"] > row["kv_bytes"]  # keys/values plus their bookkeeping
    assert row["policy"] == "tova" and row["context"] == 128 and row["continuation"] == 8
    assert 0 <= row["top1"] <= 1 and row["max_kv_bytes"] <= 0.5 * row["full_kv_bytes"]


def test_fidelity_cli_reports_bad_budget(shared_data, capsys):
    code = main(["fidelity", "--model", "smollm2", "--text", str(shared_data / "text" / "pg84.txt"),
                 "--context", "64", "--continuation", "4", "--policy", "snapkv", "--budget", "1.7"])
    assert code == 2
    assert "budget" in capsys.readouterr().err
