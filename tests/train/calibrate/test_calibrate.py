"""Calibration on a tiny model: a valid strategy, deterministic with a seed, resumable to the
same result; probes compress one layer only; the allocation keeps the floor and the sum."""
import json

import pytest
import torch

from vlm_kv.train.calibrate.calibrate import CalibrationConfig, Calibrator, allocate, calibrate, plot_strategy
from vlm_kv.train.calibrate.probes import probe_cache, probe_strategy
from vlm_kv.models.adapters import get_adapter
from vlm_kv.testing import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cal")
    rng = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    text = " ".join(words[int(i)] for i in torch.randint(0, len(words), (3000,), generator=rng))
    path = folder / "text.txt"
    path.write_text(text)
    return tiny_model("llama", num_layers=3), tiny_tokenizer("llama"), str(path), folder


def _config(**kw):
    base = dict(budget=0.2, candidates=["h2o", "streaming_llm", "tova"], context=48, continuation=6,
                evict_every=4, seed=3)
    base.update(kw)
    return CalibrationConfig(**base)


def test_probe_compresses_one_layer_only(setup):
    model, _, _, _ = setup
    fp = get_adapter(model).fingerprint()
    strategy = probe_strategy(fp, 3, 1, 0.25, {"prefill": "h2o"})
    cache = probe_cache(model, strategy, evict_every=4, seed=0)
    ids = torch.randint(5, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    heads = model.config.num_key_value_heads
    assert [layer.store.num_entries() for layer in cache.layers] == [40 * heads, 10 * heads, 40 * heads]


def test_allocate_keeps_floor_sum_and_order():
    budgets, floor = allocate([0.1, 0.4, 0.0, 0.2], budget=0.2, floor_ratio=0.5)
    assert sum(budgets) == pytest.approx(0.2)
    assert min(budgets) >= floor * (1 - 1e-9) and floor == pytest.approx(0.025)
    assert budgets[2] == pytest.approx(floor, rel=1e-6)
    assert budgets[1] > budgets[3] > budgets[0] > budgets[2]
    # a layer cannot take more than its full cache (1/L): the rest moves on
    capped, _ = allocate([100.0, 0.0, 0.0, 0.0], budget=0.6, floor_ratio=0.2)
    assert capped[0] == pytest.approx(0.25, rel=1e-6) and sum(capped) == pytest.approx(0.6)


def test_calibration_is_deterministic_and_resumes_to_the_same_result(setup):
    model, tok, text, folder = setup
    full = calibrate(model, tok, [text], _config(), progress_path=str(folder / "a.progress.json"), show_progress=False)
    again = calibrate(model, tok, [text], _config(), progress_path=None, show_progress=False)
    def strip(s):
        d = s.to_dict()
        d["calibration"].pop("measure_seconds")
        return d
    assert strip(full) == strip(again)
    assert full.num_layers == 3 and sum(e.budget for e in full.layers["prefill"]) == pytest.approx(0.2)
    signals = full.layers["prefill"][0].signals["prefill"]
    assert set(signals["kl"]) == {"h2o", "streaming_llm", "tova"}
    assert full.layers["prefill"][0].pattern == min(signals["kl"], key=signals["kl"].get)
    # interrupted run: keep only some measurements, resume, same strategy; nothing re-measured that was kept
    saved = json.loads((folder / "a.progress.json").read_text())
    assert len(saved["results"]) == 3 * 3 + 3
    keep = dict(list(saved["results"].items())[:5])
    saved["results"] = keep
    partial = folder / "b.progress.json"
    partial.write_text(json.dumps(saved))
    cal = Calibrator(model, tok, [text], _config(), progress_path=str(partial), show_progress=False)
    measured = []
    original = cal.measure
    cal.measure = lambda *a: measured.append(a) or original(*a)
    resumed = cal.run()
    assert len(measured) == 3 * 3 + 3 - 5
    assert strip(resumed) == strip(full)
    png = folder / "s.png"
    plot_strategy(resumed, str(png))
    assert png.stat().st_size > 1000


def test_decode_phase_and_refusals(setup, tmp_path):
    model, tok, text, folder = setup
    s = calibrate(model, tok, [text], _config(phases=["prefill", "decode"], candidates=["h2o", "streaming_llm"]),
                  show_progress=False)
    assert set(s.layers) == {"prefill", "decode"}
    assert all(e.pattern in {"h2o", "streaming_llm"} for e in s.layers["decode"])
    decode_kl = s.layers["prefill"][1].signals["decode"]["kl"]
    assert s.layers["decode"][1].pattern == min(decode_kl, key=decode_kl.get)
    with pytest.raises(ValueError, match="one gate kind"):
        _config(candidates=["dbtrimkv", "trimkv"]).check()
    with pytest.raises(ValueError, match="--phases"):
        _config(phases=["decode"]).check()
    progress = tmp_path / "p.progress.json"
    calibrate(model, tok, [text], _config(candidates=["h2o"]), progress_path=str(progress), show_progress=False)
    from vlm_kv.policies.strategy import StrategyError
    with pytest.raises(StrategyError, match="another calibration"):  # other windows: other measurements
        calibrate(model, tok, [text], _config(candidates=["h2o"], context=40), progress_path=str(progress),
                  show_progress=False)


def test_cli_checks_before_loading(tmp_path, capsys):
    from vlm_kv.cli.main import main

    assert main(["calibrate", "--data", str(tmp_path / "none.txt"), "--budget", "0.1", "--out", "s.json"]) == 2
    assert "text file not found" in capsys.readouterr().err
    assert main(["calibrate", "--data", "x.txt", "--budget", "0.1", "--out", "s.json", "--candidates", "magic"]) == 2
    assert "unknown policy 'magic'" in capsys.readouterr().err
    assert main(["calibrate", "--data", "x.txt", "--budget", "1.5", "--out", "s.json"]) == 2
    assert "--budget must be a fraction" in capsys.readouterr().err


def test_leave_one_out_against_a_compressed_baseline(setup, tmp_path):
    model, tok, text, _ = setup
    progress = str(tmp_path / "loo.progress.json")
    cfg = dict(baseline="tova", sensitivity=[0.5, 2.0], budget_pattern="baseline")
    s = calibrate(model, tok, [text], _config(**cfg), progress_path=progress, show_progress=False)
    saved = json.loads(open(progress).read())["results"]
    # the baseline run once; per layer the two other candidates, and two budget multiples
    assert len(saved) == 1 + 3 * 2 + 3 * 2 and "baseline|tova" in saved
    base_kl = saved["baseline|tova"]["kl"]
    for layer, entry in enumerate(s.layers["prefill"]):
        sig = entry.signals
        assert sig["prefill"]["kl"]["tova"] == base_kl  # a layer keeping the baseline is the baseline run
        assert entry.pattern == min(sig["prefill"]["kl"], key=sig["prefill"]["kl"].get)  # no margin
        curve = sig["kl_by_budget_multiple"]
        assert set(curve) == {"0.5", "1", "2"}
        assert curve["1"] == base_kl and sig["sensitivity"] == pytest.approx(max(0.0, (curve["0.5"] - curve["2"]) / 1.5))
        assert 0.0 <= sig["attention_entropy"] <= 1.0
    assert s.calibration["baseline_kl"] == base_kl and -1 <= s.calibration["entropy_vs_sensitivity_spearman"] <= 1
    # other choices from the same measurements, nothing measured: a margin no candidate clears keeps
    # the baseline everywhere; a candidate subset; a missing measurement is refused
    cal = Calibrator(model, tok, [text], _config(margin=0.99, **cfg), progress_path=progress, show_progress=False,
                     only_measured=True)
    cal.measure = lambda *a: pytest.fail("measured with only_measured")
    kept = cal.run()
    assert {e.pattern for e in kept.layers["prefill"]} == {"tova"}
    assert [e.budget for e in kept.layers["prefill"]] == pytest.approx([e.budget for e in s.layers["prefill"]])
    sub = calibrate(model, tok, [text], _config(candidates=["h2o", "tova"], **cfg), progress_path=progress,
                    show_progress=False, only_measured=True)
    assert all(e.pattern in {"h2o", "tova"} for e in sub.layers["prefill"])
    from vlm_kv.policies.strategy import StrategyError
    with pytest.raises(StrategyError, match="is not in"):
        calibrate(model, tok, [text], _config(candidates=["snapkv", "tova"], **cfg), progress_path=progress,
                  show_progress=False, only_measured=True)
    with pytest.raises(ValueError, match="must be one of the candidates"):
        _config(baseline="snapkv").check()
    with pytest.raises(ValueError, match="give --baseline"):
        _config(margin=0.1).check()


def test_gated_candidates_probe_with_the_gates(setup):
    from vlm_kv.testing import tiny_gates

    model, tok, text, _ = setup
    cfg = _config(candidates=["dbtrimkv", "tova"], baseline="tova")
    with pytest.raises(ValueError, match="needs retention gates"):  # no gates shipped for the tiny model
        Calibrator(model, tok, [text], cfg, show_progress=False)
    gates = tiny_gates(model, kind="dbtrimkv")
    s = calibrate(model, tok, [text], _config(candidates=["dbtrimkv", "tova"], baseline="tova"), show_progress=False,
                  gates=gates)
    kl = s.layers["prefill"][1].signals["prefill"]["kl"]
    assert set(kl) == {"dbtrimkv", "tova"} and kl["dbtrimkv"] != kl["tova"]
    # the strategy runs with the same gates
    import vlm_kv
    cache = vlm_kv.make_cache(model, policy="polykv", budget=0.2, strategy=s, gates=gates)
    ids = torch.randint(5, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    assert cache.kv_bytes()["total"] <= cache.budget_bytes()


def test_budget_shares_from_the_gates(setup, tmp_path):
    from vlm_kv.testing import tiny_gates

    model, tok, text, _ = setup
    gates = tiny_gates(model, kind="dbtrimkv")
    progress = str(tmp_path / "g.progress.json")
    cfg = _config(candidates=["tova"], baseline="tova", budget_pattern="baseline", budget_source="gates", floor_ratio=0.0)
    s = calibrate(model, tok, [text], cfg, progress_path=progress, show_progress=False, gates=gates)
    entries = json.loads(open(progress).read())["results"]["gate_entries|dbtrimkv"]["entries"]
    # the entries a DBTrimKV cache keeps per layer at the end of the window, at the global budget
    import vlm_kv
    from vlm_kv.train.calibrate.calibrate import calibration_windows
    from vlm_kv.train.calibrate.probes import feed
    (window,) = calibration_windows(tok, [text], cfg)
    cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.2, gates=gates,
                              options=vlm_kv.CacheOptions(evict_every=4, seed=3))
    feed(model, cache, window.ids, 48)
    assert entries == [layer.store.num_entries() for layer in cache.layers]
    budgets = [e.budget for e in s.layers["prefill"]]
    assert budgets == pytest.approx([0.2 * n / sum(entries) for n in entries], rel=1e-6)
    assert s.layers["prefill"][0].signals["gate_entries"] == entries[0]
