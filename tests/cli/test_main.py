"""The command line checks everything it can before loading a model, and says what is wrong in one line."""
import json

import pytest

import vlm_kv.cli.main as cli
from vlm_kv.cli.main import main


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(cli, "_load", refuse)


def _fidelity(text, *extra):
    return ["fidelity", "--model", "smollm2", "--text", str(text), "--context", "64", "--continuation", "4", *extra]


def test_unknown_policy_fails_before_the_model_loads(shared_data, capsys, no_model_load):
    assert main(_fidelity(shared_data / "text" / "pg84.txt", "--policy", "magic", "--budget", "0.5")) == 2
    assert "unknown policy 'magic'" in capsys.readouterr().err


def test_missing_and_empty_text_files(tmp_path, capsys, no_model_load):
    assert main(_fidelity(tmp_path / "nope.txt", "--policy", "snapkv", "--budget", "0.5")) == 2
    assert "text file not found" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(_fidelity(empty, "--policy", "snapkv", "--budget", "0.5")) == 2
    assert f"text file {empty} is empty" in capsys.readouterr().err


def test_missing_or_corrupt_gates_fail_before_the_model_loads(shared_data, tmp_path, capsys, no_model_load):
    text = shared_data / "text" / "pg84.txt"
    assert main(_fidelity(text, "--policy", "dbtrimkv", "--budget", "0.5", "--gates", str(tmp_path / "none"))) == 2
    assert "gate" in capsys.readouterr().err.lower()


def test_empty_model_folder_says_no_model(shared_data, tmp_path, capsys, no_model_load):
    args = ["fidelity", "--model", str(tmp_path), "--text", str(shared_data / "text" / "pg84.txt"),
            "--context", "64", "--continuation", "4", "--policy", "snapkv", "--budget", "0.5"]
    assert main(args) == 2
    assert f"no model in {tmp_path}" in capsys.readouterr().err


@pytest.mark.parametrize("extra, says", [
    (("--continuation", "0"), "--continuation must be >= 1 token, got 0"),
    (("--context", "0"), "--context must be >= 1 token, got 0"),
    (("--offset", "10000000"), "--offset 10000000 is past the end"),
    (("--offset", "-3"), "--offset must be >= 0"),
    (("--policy", "kivi2"), "pass budget=1.0"),
    (("--policy", "full"), "'full' is the uncompressed cache and keeps every token: it takes no budget"),
    (("--budget", "1"), "budget 1 is ambiguous"),
])
def test_fidelity_checks_every_argument_before_the_model_loads(shared_data, capsys, no_model_load, extra, says):
    text = shared_data / "text" / "pg84.txt"
    args = dict(zip(["--policy", "--budget", "--context", "--continuation"], ["snapkv", "0.5", "64", "4"]))
    args.update(zip(extra[::2], extra[1::2]))
    argv = ["fidelity", "--model", "smollm2", "--text", str(text), *[x for kv in args.items() for x in kv]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_fidelity_needs_as_many_characters_as_tokens(tmp_path, capsys, no_model_load):
    short = tmp_path / "short.txt"
    short.write_text("a few words only")
    assert main(_fidelity(short, "--policy", "snapkv", "--budget", "0.5")) == 2
    assert "has 16 characters, fewer than the 69 tokens needed" in capsys.readouterr().err


def test_bench_checks_budgets_and_policies_before_timing(capsys, no_model_load):
    assert main(["bench", "--contexts", "64", "--budgets", "1.5"]) == 2
    assert "budget" in capsys.readouterr().err
    assert main(["bench", "--contexts", "64", "--policies", "snapkv,nope"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err
    assert main(["bench", "--contexts", "64", "--repeats", "0", "--interleave"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err
    assert main(["bench", "--contexts", "64", "--evict-every", "0"]) == 2
    assert "--evict-every must be >= 1" in capsys.readouterr().err


def test_demo_checks_budget_and_policy_first(capsys, no_model_load):
    assert main(["demo", "--budget", "1.5"]) == 2
    assert main(["demo", "--policy", "nope"]) == 2
    err = capsys.readouterr().err
    assert "budget" in err and "unknown policy" in err


def test_bench_json_rows_have_the_documented_keys(capsys, monkeypatch, smollm2):
    monkeypatch.setattr(cli, "_load", lambda *args, **kwargs: smollm2)
    code = main(["bench", "--contexts", "96", "--policies", "snapkv", "--budgets", "0.5", "--steps", "3",
                 "--repeats", "1", "--prefill-chunk", "48", "--evict-every", "2", "--json", "--in-process"])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["policy"] for r in rows] == ["full", "snapkv"]
    keys = {"policy", "budget", "context", "prefill_chunk", "prefill_s", "decode_ms_per_token", "tokens_per_s",
            "evict_share", "peak_kv_bytes_prefill", "peak_kv_bytes_decode", "peak_memory_bytes", "device", "dtype",
            "evict_every"}
    assert all(set(r) == keys for r in rows)
    full, snap = rows
    assert snap["prefill_chunk"] == 48 and full["prefill_chunk"] is None
    assert snap["evict_every"] == 2 and full["evict_every"] is None
    # chunked prefill holds about budget + chunk, far below the full cache's 96 tokens
    assert snap["peak_kv_bytes_prefill"] < full["peak_kv_bytes_prefill"]
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0 for r in rows)


def test_bench_runs_each_row_in_its_own_process_by_default(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("the parent process must not load the model"))
    code = main(["bench", "--contexts", "64", "--policies", "h2o", "--budgets", "0.25", "--steps", "2",
                 "--repeats", "1", "--json"])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [(r["policy"], r["context"]) for r in rows] == [("full", 64), ("h2o", 64)]
    full, h2o = rows
    assert h2o["peak_kv_bytes_decode"] < full["peak_kv_bytes_decode"]
    assert all(r["peak_memory_bytes"] > 0 and r["tokens_per_s"] > 0 for r in rows)


def test_bench_interleave_runs_every_cache_once_per_repeat(capsys, monkeypatch, smollm2):
    import vlm_kv.cli.bench as bench

    monkeypatch.setattr(cli, "_load", lambda *args, **kwargs: smollm2)
    order = []
    real = bench.run_planned

    def recording(model, ids, run, plan, repeats):
        assert repeats == 1  # one fresh prefill + decode per cache and round
        order.append(run[1])
        return real(model, ids, run, plan, repeats)

    monkeypatch.setattr(bench, "run_planned", recording)
    code = main(["bench", "--contexts", "64", "--policies", "snapkv,h2o", "--budgets", "0.5", "--steps", "2",
                 "--repeats", "3", "--json", "--interleave"])
    assert code == 0
    # the order rotates between rounds, so no cache always runs first
    assert order == ["full", "snapkv", "h2o", "snapkv", "h2o", "full", "h2o", "full", "snapkv"]
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["policy"] for r in rows] == ["full", "snapkv", "h2o"]
    assert all(r["tokens_per_s"] == pytest.approx(1000 / r["decode_ms_per_token"]) for r in rows)
    assert rows[1]["peak_kv_bytes_decode"] < rows[0]["peak_kv_bytes_decode"]


def test_median_row_takes_medians_of_times_and_maxima_of_peaks():
    from vlm_kv.cli.bench import BenchRow, median_row

    def row(prefill, ms, peak):
        return BenchRow("snapkv", 0.1, 64, None, prefill, ms, 1000 / ms, 0.1, peak, peak, peak, "cpu", "float32")

    out = median_row([row(3.0, 10.0, 5), row(1.0, 30.0, 7), row(2.0, 20.0, 6)])
    assert (out.prefill_s, out.decode_ms_per_token, out.tokens_per_s) == (2.0, 20.0, 50.0)
    assert out.peak_kv_bytes_prefill == out.peak_memory_bytes == 7


def test_tier_options_are_checked_before_the_model_loads(shared_data, capsys, no_model_load):
    text = shared_data / "text" / "pg84.txt"
    assert main(_fidelity(text, "--policy", "h2o", "--budget", "0.1", "--window", "4")) == 2
    assert "--tiers int2" in capsys.readouterr().err
    assert main(_fidelity(text, "--policy", "h2o", "--budget", "0.1", "--tiers", "int2", "--int2-share", "1.5")) == 2
    assert "int2_share" in capsys.readouterr().err
    assert main(_fidelity(text, "--policy", "h2o", "--budget", "0.1", "--tiers", "int2", "--int2-value", "0")) == 2
    assert "int2_value" in capsys.readouterr().err
    assert main(_fidelity(text, "--policy", "h2o", "--budget", "0.1", "--int2-value", "0.5")) == 2
    assert "--tiers int2" in capsys.readouterr().err
    assert main(_fidelity(text, "--policy", "h2o", "--budget", "0.1", "--int2-basis", "hadamard")) == 2
    assert "--int2-basis needs --tiers int2" in capsys.readouterr().err


def test_fidelity_with_tiers_reports_them_and_holds_the_budget(shared_data, capsys, monkeypatch, smollm2):
    monkeypatch.setattr(cli, "_load", lambda *args, **kwargs: smollm2)
    text = shared_data / "text" / "pg84.txt"
    code = main(_fidelity(text, "--policy", "h2o", "--budget", "0.25", "--tiers", "int2", "--window", "4",
                          "--int2-basis", "hadamard", "--offset", "100000", "--json"))
    assert code == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["tiers"] == "int2" and row["window"] == 4 and row["basis"] == "hadamard"
    assert 0 < row["max_kv_bytes"] <= 0.25 * row["full_kv_bytes"] + 1
