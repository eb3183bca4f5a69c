import json

from vlm_kv.kernels.bench_kernels import main


def test_bench_runs_and_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.jsonl"
    rows = main(["--device", "cpu", "--dtype", "float32", "--lengths", "40,96", "--batch", "1", "--kv-heads", "2",
                 "--group", "3", "--head-dim", "16", "--repeats", "2", "--copy-mib", "4", "--json", str(path)])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == rows
    assert {(r["store"], r["length"]) for r in rows} == {("fp", 40), ("fp", 96), ("mixed0.7", 40), ("mixed0.7", 96)}
    for r in rows:
        assert r["backend"] == "torch" and r["ms"] > 0 and r["copy_fraction"] > 0
    fp96 = next(r for r in rows if r["store"] == "fp" and r["length"] == 96)
    assert fp96["kv_bytes"] == 2 * 96 * 2 * 16 * 4  # rows x length x (K and V) x head_dim x fp32
    assert "copy bandwidth" in capsys.readouterr().out
