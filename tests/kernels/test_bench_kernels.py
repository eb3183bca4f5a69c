import json

from vlm_kv.kernels.bench_kernels import main


def test_bench_runs_and_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.jsonl"
    rows = main(["--device", "cpu", "--dtype", "float32", "--lengths", "40,96", "--batch", "1", "--kv-heads", "2",
                 "--group", "3", "--head-dim", "16", "--repeats", "2", "--copy-mib", "4", "--json", str(path)])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == rows
    assert {(r["backend"], r["store"], r["length"]) for r in rows} == {
        (backend, store, length) for length in (40, 96)
        for backend, store in (("sdpa", "dense"), ("torch", "fp"), ("torch", "mixed0.7"))}
    for r in rows:
        assert r["ms"] > 0 and r["copy_fraction"] > 0
    fp96 = next(r for r in rows if r["store"] == "fp" and r["length"] == 96)
    mixed96 = next(r for r in rows if r["store"] == "mixed0.7" and r["length"] == 96)
    # 0.7 of 96 -> 8 windows of 8 in INT2, 32 entries in FP
    assert mixed96["kv_bytes"] == 2 * (32 * 2 * 16 * 4 + 8 * (8 * 16 // 2 + 4 * 16 + 4 * 8))
    assert fp96["kv_bytes"] == 2 * 96 * 2 * 16 * 4  # rows x length x (K and V) x head_dim x fp32
    assert "copy bandwidth" in capsys.readouterr().out
