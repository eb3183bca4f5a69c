"""``vlm-kv sweep --task multimodal``: rows per (policy, budget, task), resume, refusals (tiny LM, code paths)."""

import json

import pytest

import vlm_kv.cli.main as cli
from vlm_kv.eval import multimodal_sweep as MS
from vlm_kv.eval import sweep_cli
from vlm_kv.eval.multimodal import MultimodalBench, MultimodalSettings


@pytest.fixture(scope="module")
def tiny(tiny_smollava):
    return tiny_smollava


def _bench(tiny, **kw):
    settings = MultimodalSettings(data_seed=3, items=1, tasks=("single", "multi_turn"), max_new_tokens=2, **kw)
    return MultimodalBench(*tiny, settings)


def test_rows_per_policy_budget_and_task_then_resume(tiny, tmp_path, monkeypatch):
    rows = MS.run_multimodal_sweep(_bench(tiny), ["snapkv"], [0.5], tmp_path, model_name="tiny", progress=False)
    assert [(r["policy"], r["budget"], r["task"]) for r in rows] == [
        ("full", 1.0, "single"), ("full", 1.0, "multi_turn"), ("snapkv", 0.5, "single"), ("snapkv", 0.5, "multi_turn")]
    table = json.loads((tmp_path / "sweep_multimodal.json").read_text())
    assert table["task"] == "multimodal" and table["settings"]["data_seed"] == 3 and table["rows"] == rows
    for r in rows:
        assert {"accuracy", "full_accuracy", "relative_accuracy", "chance", "kl", "kv_bytes", "full_kv_bytes",
                "max_kv_bytes", "visual_share", "items", "error"} <= set(r)
    assert rows[2]["kv_bytes"] < rows[2]["full_kv_bytes"]
    assert (tmp_path / "sweep_multimodal.csv").read_text().splitlines()[0].startswith("policy,budget,task")
    assert (tmp_path / "sweep_multimodal_accuracy.png").stat().st_size > 0
    # a rerun keeps every finished row
    bench = _bench(tiny)
    monkeypatch.setattr(bench, "run_task", lambda *a: pytest.fail("a finished row ran again"))
    assert MS.run_multimodal_sweep(bench, ["snapkv"], [0.5], tmp_path, model_name="tiny", progress=False,
                                   plots=False) == rows
    with pytest.raises(ValueError, match="other settings .*images"):
        MS.run_multimodal_sweep(_bench(tiny, images="noise"), ["snapkv"], [0.5], tmp_path, model_name="tiny",
                                progress=False)


def test_kvzip_is_refused_before_any_cell_runs(tiny, tmp_path, monkeypatch):
    bench = _bench(tiny)
    monkeypatch.setattr(bench, "run_task", lambda *a: pytest.fail("a cell ran"))
    with pytest.raises(ValueError, match="kvzip scores the context by reading it back"):
        MS.run_multimodal_sweep(bench, ["snapkv", "kvzip"], [0.5], tmp_path, model_name="tiny", progress=False)
    assert not (tmp_path / "sweep_multimodal.json").exists()


def test_a_run_with_other_budgets_keeps_the_earlier_rows(tiny, tmp_path):
    first = MS.run_multimodal_sweep(_bench(tiny), ["snapkv"], [0.5], tmp_path, model_name="tiny", progress=False,
                                    plots=False)
    second = MS.run_multimodal_sweep(_bench(tiny), ["snapkv"], [0.25], tmp_path, model_name="tiny", progress=False,
                                     plots=False)
    assert [(r["policy"], r["budget"]) for r in second] == [("full", 1.0)] * 2 + [("snapkv", 0.25)] * 2
    kept = json.loads((tmp_path / "sweep_multimodal.json").read_text())["rows"]
    assert kept == second + first[2:]  # this run's rows, then the earlier run's other rows, unchanged
    assert len((tmp_path / "sweep_multimodal.csv").read_text().splitlines()) == 1 + 6


def test_cli_runs_the_multimodal_task(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep_cli, "is_vlm", lambda name: True)
    monkeypatch.setattr(sweep_cli, "load_vlm", lambda name, device=None: tiny)
    code = cli.main(["sweep", "--task", "multimodal", "--model", "smollava", "--data-seed", "3", "--items", "1",
                     "--tasks", "single", "--images", "noise", "--max-new-tokens", "2", "--policies", "h2o",
                     "--budgets", "0.5", "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    table = json.loads((tmp_path / "sweep_multimodal.json").read_text())
    assert table["settings"]["images"] == "noise" and table["settings"]["model"] == "smollava"
    assert [(r["policy"], r["task"]) for r in table["rows"]] == [("full", "single"), ("h2o", "single")]
    assert "relative_accuracy" in capsys.readouterr().out
    assert cli.main(["sweep", "--task", "multimodal", "--model", "smollava", "--images", "blur", "--policies", "h2o",
                     "--budgets", "0.5", "--out", str(tmp_path / "x")]) == 2
    assert "images must be 'real' or 'noise'" in capsys.readouterr().err


def test_cli_allocation_kwargs_reach_every_cache(tiny, tmp_path, monkeypatch, capsys):
    # a modality cap on dbtrimkv's global allocation takes effect (the cap is a share of the
    # budget, so with few text entries to fill the rest the kept share can sit above it)
    from vlm_kv.gates.io import save_gates
    from vlm_kv.gates.retention_gate import GateConfig, RetentionGates
    from vlm_kv.models.adapters import get_adapter

    a = get_adapter(tiny[0])
    save_gates(RetentionGates(GateConfig(hidden_size=a.hidden_size, num_layers=a.num_layers,
                                         num_kv_heads=a.num_kv_heads, width=8, model=a.fingerprint())),
               str(tmp_path / "gates"))
    monkeypatch.setattr(sweep_cli, "is_vlm", lambda name: True)
    monkeypatch.setattr(sweep_cli, "load_vlm", lambda name, device=None: tiny)
    args = ["sweep", "--task", "multimodal", "--model", "smollava", "--data-seed", "3", "--items", "1",
            "--tasks", "single", "--max-new-tokens", "2", "--policies", "dbtrimkv", "--budgets", "0.5",
            "--gates", str(tmp_path / "gates"), "--no-progress"]
    share = {}
    for name, extra in (("free", []), ("capped", ["--allocation-kwargs", '{"modality_cap": {"image": 0.2}}'])):
        assert cli.main([*args, *extra, "--out", str(tmp_path / name)]) == 0
        table = json.loads((tmp_path / name / "sweep_multimodal.json").read_text())
        share[name] = table["rows"][-1]["visual_share"]
    capsys.readouterr()
    assert share["free"] > 0.5 and share["capped"] < share["free"] / 2
    assert table["settings"]["cache_kwargs"]["options"]["allocation_kwargs"] == {"modality_cap": {"image": 0.2}}
    # refused by name before any model loads: not JSON, not an object, a field the allocation lacks
    for bad, said in (("{oops", "not JSON"), ("[1]", "JSON object"), ('{"windw": 3}', "windw")):
        assert cli.main([*args, "--allocation-kwargs", bad, "--out", str(tmp_path / "bad")]) == 2
        assert said in capsys.readouterr().err
