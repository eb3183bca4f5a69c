"""Strategy files: round trip, refusal for another model, inconsistent budgets, unknown patterns."""
import json

import pytest

from vlm_kv.models.adapters import get_adapter
from vlm_kv.policies.strategy import LayerEntry, Strategy, StrategyError, uniform_strategy
from vlm_kv.testing import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_layers=3)


def _strategy(model, budgets=(0.05, 0.1, 0.15), patterns=("h2o", "streaming_llm", "snapkv"), floor=0.02):
    fp = get_adapter(model).fingerprint()
    layers = {"prefill": [LayerEntry(p, b, signals={"kl": {p: 0.1}}) for p, b in zip(patterns, budgets)],
              "decode": [LayerEntry("tova", sum(budgets) / 3) for _ in budgets]}
    return Strategy(model=fp, budget=sum(budgets), layers=layers, floor=floor, candidates=list(patterns),
                    calibration={"data": ["x.txt"], "context": 64})


def test_round_trip(tmp_path, model):
    s = _strategy(model).validate()
    path = tmp_path / "s.json"
    s.save(str(path))
    loaded = Strategy.load(str(path), model=model)
    assert loaded.to_dict() == s.to_dict()
    assert [e.pattern for e in loaded.phase("prefill")] == ["h2o", "streaming_llm", "snapkv"]
    assert [e.pattern for e in loaded.phase("decode")] == ["tova"] * 3
    assert loaded.relative_shares("prefill") == pytest.approx([0.5, 1.0, 1.5])


def test_one_phase_serves_both(model):
    s = uniform_strategy(get_adapter(model).fingerprint(), 0.3, ["h2o", "tova", "snapkv"])
    assert s.phase("decode") is s.phase("prefill")
    assert s.relative_shares("decode") == pytest.approx([1.0, 1.0, 1.0])


def test_another_model_is_refused(tmp_path, model):
    path = tmp_path / "s.json"
    _strategy(model).save(str(path))
    other = tiny_model("qwen2", num_layers=3)
    with pytest.raises(StrategyError, match="calibrated for .* but the model is"):
        Strategy.load(str(path), model=other)


def test_budgets_must_sum_to_the_global_budget(model):
    s = _strategy(model)
    s.budget = 0.5
    with pytest.raises(StrategyError, match=r"sum to 0.3 but the global budget is 0.5"):
        s.validate()


def test_budget_below_floor_is_refused(model):
    with pytest.raises(StrategyError, match="layer 0 .* below the floor"):
        _strategy(model, budgets=(0.01, 0.14, 0.15)).validate()


def test_unknown_pattern_is_refused(tmp_path, model):
    data = _strategy(model).to_dict()
    data["layers"]["prefill"][1]["pattern"] = "magic"
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    with pytest.raises(StrategyError, match="layer 1 .*unknown policy 'magic'"):
        Strategy.load(str(path))


def test_nested_polykv_and_full_are_refused(model):
    for bad in ("polykv", "full"):
        with pytest.raises(StrategyError, match="cannot be a layer pattern"):
            _strategy(model, patterns=(bad, "h2o", "tova")).validate()


def test_wrong_layer_count_and_over_full_layer(model):
    fp = get_adapter(model).fingerprint()
    with pytest.raises(StrategyError, match="2 layers but its model fingerprint says 3"):
        uniform_strategy(fp, 0.2, ["h2o", "tova"])
    with pytest.raises(StrategyError, match="exceeds a full layer"):
        _strategy(model, budgets=(0.5, 0.1, 0.1)).validate()


def test_corrupt_and_missing_files(tmp_path):
    path = tmp_path / "s.json"
    path.write_text("{not json")
    with pytest.raises(StrategyError, match="corrupt strategy file"):
        Strategy.load(str(path))
    with pytest.raises(FileNotFoundError, match="strategy file not found"):
        Strategy.load(str(tmp_path / "none.json"))
    path.write_text(json.dumps({"model": {"config_hash": "x"}, "budget": 0.1}))
    with pytest.raises(StrategyError, match="malformed strategy"):
        Strategy.load(str(path))


def test_ablations_keep_one_half_of_the_strategy(model):
    s = _strategy(model).validate()
    uniform = s.with_uniform_budgets()
    assert [e.pattern for e in uniform.phase("prefill")] == ["h2o", "streaming_llm", "snapkv"]
    assert uniform.relative_shares("prefill") == pytest.approx([1.0, 1.0, 1.0])
    single = s.with_pattern("adakv")
    assert {e.pattern for e in single.phase("decode")} == {"adakv"}
    assert single.relative_shares("prefill") == pytest.approx(s.relative_shares("prefill"))
    with pytest.raises(StrategyError, match="unknown policy"):
        s.with_pattern("nope")


# ------------------------------------------------------------------ --strategy on the command lines

def test_bench_passes_the_strategy_to_polykv_only(monkeypatch):
    import vlm_kv.cli.bench as bench_mod

    made = []
    monkeypatch.setattr(bench_mod, "make_cache", lambda model, **kw: made.append(kw))
    monkeypatch.setattr(bench_mod, "bench_tokens", lambda *a: None)
    monkeypatch.setattr(bench_mod, "run_one", lambda model, ids, context, steps, repeats, factory, *rest: factory())
    monkeypatch.setattr(bench_mod, "DynamicCache", lambda config: made.append("full"))
    monkeypatch.setattr(bench_mod, "warm_up", lambda model: None)
    model = type("M", (), {"config": None})()
    plan = bench_mod.BenchPlan((64,), ("snapkv", "polykv"), (0.1,), strategy="s.json")
    list(bench_mod.bench(model, None, plan, progress=False))
    assert made[0] == "full" and [kw.get("strategy") for kw in made[1:]] == [None, "s.json"]


def test_clis_take_a_strategy(monkeypatch, capsys):
    import argparse

    import vlm_kv.cli.main as cli
    from vlm_kv.eval.lmms_eval_model import split_model_args
    from vlm_kv.eval.sweep_cli import _cache_kwargs

    monkeypatch.setattr(cli, "_load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("model loaded")))
    assert cli.main(["bench", "--policies", "snapkv", "--strategy", "s.json"]) == 2
    assert "--strategy is for policy 'polykv'" in capsys.readouterr().err
    seen = {}
    monkeypatch.setattr(cli, "run_demo", lambda **kw: seen.update(kw) or 0)
    monkeypatch.setattr(cli, "check_model", lambda name: None)
    assert cli.main(["demo", "--policy", "polykv", "--strategy", "s.json"]) == 0 and seen["strategy"] == "s.json"
    _, cache = split_model_args("pretrained=/m,policy=polykv,budget=0.1,strategy=s.json")
    assert cache == {"policy": "polykv", "budget": 0.1, "strategy": "s.json"}
    args = argparse.Namespace(evict_every=None, gates=None, strategy="s.json", policies=["full", "polykv"])
    assert _cache_kwargs(args) == {"strategy": "s.json"}
    args.policies = ["polykv", "h2o"]
    with pytest.raises(ValueError, match="sweep h2o without it"):
        _cache_kwargs(args)
    for argv in (["eval", "mathvision", "--model", "m", "--policy", "polykv", "--budget", "0.1", "--strategy", "s.json"],
                 ["eval", "mmdu", "--model", "m", "--data", "d", "--images", "i", "--policy", "polykv", "--budget", "0.1",
                  "--strategy", "s.json"]):
        assert cli.build_parser().parse_args(argv).strategy == "s.json"
