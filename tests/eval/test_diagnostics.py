"""Diagnostics of eviction decisions: FMM, churn and LIR on hand-built events with known answers,
and the runner end to end on a tiny random model (code paths only, never quality)."""
import json
import math

import pytest
import torch

import vlm_kv.cli.main as cli
from vlm_kv.eval.diagnostics import (
    RoutingEvent,
    diagnose,
    future_missed_mass,
    held_token_mask,
    latent_reactivation,
    load_result,
    plot,
    reference_attention,
    selection_churn,
    summarize,
    window_sets,
)
from vlm_kv.config import CacheOptions
from vlm_kv.testing import tiny_model, tiny_tokenizer


def event(step: int, seen: int, accessible: list[int], selected: list[int] | None = None) -> RoutingEvent:
    """One layer, one kv head: window flags given as 0/1 lists."""
    acc = torch.tensor(accessible, dtype=torch.bool).view(1, 1, -1)
    sel = acc if selected is None else torch.tensor(selected, dtype=torch.bool).view(1, 1, -1)
    return RoutingEvent(step=step, seen=seen, accessible=acc, selected=sel)


def attention_rows(rows: list[list[float]], positions: int) -> torch.Tensor:
    out = torch.zeros(len(rows), 1, 1, positions)
    for s, row in enumerate(rows):
        out[s, 0, 0, : len(row)] = torch.tensor(row)
    return out


# ----------------------------------------------------------------------------- window sets


def test_window_sets_mark_held_windows_and_full_precision_ones():
    positions = torch.tensor([[0, 5, 9, -1], [3, -1, -1, -1]])
    tiers = torch.tensor([[0, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.uint8)
    accessible, selected = window_sets(positions, tiers, window=4, num_windows=3)
    assert accessible.tolist() == [[True, True, True], [True, False, False]]
    # position 5 is INT2 (window 1 reachable, not FP); empty slots mark nothing whatever their tier
    assert selected.tolist() == [[True, False, True], [False, False, False]]


def test_window_sets_reject_positions_past_the_windows():
    with pytest.raises(ValueError, match="past the last"):
        window_sets(torch.tensor([[12]]), torch.zeros(1, 1, dtype=torch.uint8), window=4, num_windows=3)


def test_held_token_mask_marks_positions_and_skips_empty_slots():
    mask = held_token_mask(torch.tensor([[0, 5, -1], [2, -1, -1]]), num_positions=6)
    assert mask.tolist() == [[True, False, False, False, False, True], [False, False, True, False, False, False]]
    with pytest.raises(ValueError, match="past the 6 positions"):
        held_token_mask(torch.tensor([[6]]), num_positions=6)


# ----------------------------------------------------------------------------- FMM


def test_fmm_is_the_future_share_on_evicted_windows():
    # prefill of 6 positions, windows of 2: {0,1} {2,3} {4,5}; window 1 evicted at the event
    step0 = [0.1, 0.1, 0.2, 0.2, 0.1, 0.1, 0.2]            # query at position 6
    step1 = [0.05, 0.05, 0.3, 0.1, 0.1, 0.1, 0.1, 0.2]     # query at position 7
    attention = attention_rows([step0, step1], 8)
    events = [event(0, 6, [1, 0, 1])]
    (one,) = future_missed_mass(attention, events, window=2, horizon=1)
    assert one["future_steps"] == 1
    assert one["fmm"].item() == pytest.approx(0.4 / 0.8)
    (two,) = future_missed_mass(attention, events, window=2, horizon=32)
    # positions 6 and 7 did not exist at the event: neither counts
    assert two["future_steps"] == 2
    assert two["fmm"].item() == pytest.approx((0.4 + 0.4) / (0.8 + 0.7))


def test_fmm_counts_only_the_existing_tokens_of_a_filling_window():
    attention = attention_rows([[0.1, 0.1, 0.1, 0.1, 0.2, 0.4]], 6)  # query at position 5
    events = [event(0, 5, [1, 1, 0])]  # window 2 holds position 4 only, and it was evicted
    (row,) = future_missed_mass(attention, events, window=2, horizon=4)
    assert row["fmm"].item() == pytest.approx(0.2 / 0.6)


def test_fmm_is_zero_when_everything_is_reachable_and_skips_events_without_a_future():
    attention = attention_rows([[0.5, 0.5], [0.2, 0.3, 0.5]], 3)
    events = [event(0, 1, [1, 0]), event(2, 3, [1, 1])]
    rows = future_missed_mass(attention, events, window=1, horizon=8)
    assert [r["step"] for r in rows] == [0]
    assert rows[0]["fmm"].item() == 0.0


# ----------------------------------------------------------------------------- churn


def test_churn_is_one_minus_jaccard_over_windows_complete_at_the_earlier_event():
    events = [event(0, 8, [1, 1, 1, 0, 0]), event(4, 12, [1, 1, 0, 1, 1]), event(8, 16, [1, 1, 0, 1, 1])]
    churn = selection_churn(events, window=2)
    # {0,1,2} vs {0,1,3} over windows 0..3: intersection 2, union 4; window 4 is newer
    assert churn[0]["churn"].item() == pytest.approx(0.5)
    assert churn[1]["churn"].item() == 0.0  # identical sets
    assert [c["step"] for c in churn] == [4, 8]


def test_churn_of_disjoint_sets_is_one_and_of_two_empty_sets_zero():
    disjoint = selection_churn([event(0, 4, [1, 0]), event(1, 5, [0, 1, 0])], window=2)
    assert disjoint[0]["churn"].item() == 1.0
    empty = selection_churn([event(0, 4, [0, 0]), event(1, 5, [0, 0, 0])], window=2)
    assert empty[0]["churn"].item() == 0.0


# ----------------------------------------------------------------------------- LIR


def lir_events(fp_flags: list[int], every: int = 8) -> list[RoutingEvent]:
    """Window 0 (always complete) accessible in INT2 when not FP; window 1 always FP."""
    return [event(i * every, 16, [1, 1], [flag, 1]) for i, flag in enumerate(fp_flags)]


def test_a_window_demoted_for_m_events_and_promoted_within_the_horizon_reactivates():
    events = lir_events([1, 0, 0, 1, 1])  # out at steps 8 and 16 (qualifies at 16), back at 24
    counts = latent_reactivation(events, window=8, m=2, horizon=16, total_steps=32)
    assert (counts.runs, counts.reactivated, counts.censored) == (1, 1, 0)
    assert counts.lir == 1.0


def test_a_promotion_after_the_horizon_does_not_count():
    events = lir_events([1, 0, 0, 0, 0, 1])  # qualifies at 16, back at 40 > 16 + 16
    counts = latent_reactivation(events, window=8, m=2, horizon=16, total_steps=48)
    assert (counts.runs, counts.reactivated, counts.censored) == (1, 0, 0)
    assert counts.lir == 0.0


def test_runs_shorter_than_m_do_not_count_and_each_run_counts_once():
    short = latent_reactivation(lir_events([1, 0, 1, 0, 1]), window=8, m=2, horizon=16, total_steps=64)
    assert short.runs == 0 and math.isnan(short.lir)
    # one long run out (qualifies at 8 with m=1, expires), then a second run that comes back
    long = latent_reactivation(lir_events([0, 0, 0, 0, 1, 0, 1]), window=8, m=1, horizon=8, total_steps=64)
    assert (long.runs, long.reactivated) == (2, 1)


def test_right_censored_runs_leave_the_denominator():
    # qualifies at step 16, its horizon ends at 32 = the last step fed: observed, not reselected
    observed = latent_reactivation(lir_events([1, 0, 0, 0, 0]), window=8, m=2, horizon=16, total_steps=32)
    assert (observed.runs, observed.reactivated, observed.censored) == (1, 0, 0)
    # qualifies at step 24, the text ends at 24 < 24 + 16, never reselected: censored
    late = latent_reactivation(lir_events([1, 1, 0, 0]), window=8, m=2, horizon=16, total_steps=24)
    assert (late.runs, late.censored) == (0, 1) and math.isnan(late.lir)
    # a run reselected before the end counts even though its horizon reaches past it
    back = latent_reactivation(lir_events([1, 0, 0, 1]), window=8, m=2, horizon=16, total_steps=24)
    assert (back.runs, back.reactivated, back.censored) == (1, 1, 0)


def test_evicted_windows_never_reactivate_in_an_untiered_cache():
    # untiered: selected == accessible, and a complete window once gone stays gone
    events = [event(8 * i, 16, [1, 0] if i else [1, 1]) for i in range(6)]
    counts = latent_reactivation(events, window=8, m=2, horizon=16, total_steps=40)
    assert counts.runs == 1 and counts.lir == 0.0


def test_summary_adds_the_token_level_missed_mass_when_held_tokens_are_recorded():
    attention = attention_rows([[0.1, 0.3, 0.2, 0.4]], 4)  # query at position 3
    held = torch.tensor([True, False, True, False]).view(1, 1, -1)
    ev = RoutingEvent(step=0, seen=3, accessible=torch.tensor([True, True]).view(1, 1, -1),
                      selected=torch.tensor([True, True]).view(1, 1, -1), held_tokens=held)
    result = summarize([ev], attention, window=2, horizon=1, lir_m=2)
    (row,) = result.events
    # windows {0,1} and {2} both reachable; token 1 is gone: 0.3 of the 0.6 on the history
    assert row["fmm"] == 0.0 and row["fmm_tokens"] == pytest.approx(0.5)
    assert row["held_share"] == pytest.approx(2 / 3) and result.summary["held_share_per_layer"] == [pytest.approx(2 / 3)]
    assert result.summary["fmm_tokens_mean"] == pytest.approx(0.5)


def test_summary_averages_full_horizon_events_only():
    attention = attention_rows([[0.5, 0.5, 0.0]] * 2 + [[0.25, 0.25, 0.5]], 3)
    events = [event(0, 2, [1, 0]), event(2, 2, [0, 0])]
    result = summarize(events, attention, window=1, horizon=2, lir_m=1, params={"policy": "x"})
    first, second = result.events
    assert first["fmm"] == pytest.approx(0.5) and first["future_steps"] == 2
    assert second["fmm"] == pytest.approx(1.0) and second["future_steps"] == 1
    assert result.summary["fmm_events"] == 1 and result.summary["fmm_mean"] == pytest.approx(0.5)
    assert second["churn"] == pytest.approx(1.0) and first["churn"] is None


# ----------------------------------------------------------------------------- runner


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", num_layers=2), tiny_tokenizer("llama")


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog; then it rests a while. " * 8)
    return path


def _diagnose(tiny, text_file, policy, budget):
    model, tok = tiny
    return diagnose(model, tok, str(text_file), policy, budget, context=48, continuation=24, horizon=8,
                    window=4, lir_m=2, options=CacheOptions(evict_every=4))


def test_reference_attention_rows_are_distributions_over_the_past(tiny):
    model, _ = tiny
    ids = torch.randint(20, 200, (1, 20), generator=torch.Generator().manual_seed(0))
    before = model.config._attn_implementation
    attention = reference_attention(model, ids, 16)
    assert attention.shape == (4, 2, 2, 20)  # steps, layers, kv heads, positions
    sums = attention.float().sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums), atol=2e-3)
    for s in range(4):  # nothing past the query's own position
        assert attention[s, ..., 16 + s + 1 :].abs().sum() == 0
    assert model.config._attn_implementation == before  # restored afterwards (eager only inside)


def test_runner_at_full_budget_misses_nothing_and_does_not_churn(tiny, text_file):
    result = _diagnose(tiny, text_file, "h2o", 1.0)
    assert [e["step"] for e in result.events] == [0, 4, 8, 12, 16, 20, 24]
    assert all(e["fmm"] == 0.0 and e["fmm_tokens"] == 0.0 for e in result.events if e["fmm"] is not None)
    assert all(e["churn"] == 0.0 for e in result.events[1:])
    s = result.summary
    assert s["fmm_mean"] == 0.0 and s["churn_mean"] == 0.0 and s["fmm_events"] == 5
    assert all(e["held_share"] == 1.0 for e in result.events) and s["held_share_per_layer"] == [1.0, 1.0]
    assert s["lir_runs"] == 0 and s["lir"] is None


def test_runner_under_a_small_budget_reports_bounded_figures(tiny, text_file):
    result = _diagnose(tiny, text_file, "h2o", 0.3)
    assert len(result.events) == 7
    for e in result.events:
        assert 0.0 < e["accessible_share"] < 1.0
        assert e["fp_share"] == e["accessible_share"]  # untiered: everything held is FP
        assert 0.2 < e["held_share"] < 0.4  # about the budget's 0.3 of the tokens
        if e["fmm"] is not None:
            # softmax mass is positive everywhere, so an unreachable window always costs some
            assert 0.0 < e["fmm"] < 1.0 and len(e["fmm_per_layer"]) == 2
            # a window counts as reachable while one of its tokens is held: tokens miss at least as much
            assert e["fmm"] <= e["fmm_tokens"] < 1.0
    assert all(0.0 <= e["churn"] <= 1.0 for e in result.events[1:])
    s = result.summary
    assert s["lir_runs"] > 0 and s["lir"] == 0.0  # nothing evicted comes back without tiers
    json.dumps(result.as_dict())


# ----------------------------------------------------------------------------- command line


def _cli_args(text_file, *extra):
    return ["diagnose", "--model", "smollm2", "--text", str(text_file), "--context", "48", "--continuation", "16",
            "--window", "4", "--horizon", "8", "--evict-every", "4", "--policy", "snapkv", "--budget", "0.5", *extra]


def test_cli_json_and_plot(tiny, text_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_load", lambda *args, **kwargs: tiny)
    png = tmp_path / "diag.png"
    assert cli.main(_cli_args(text_file, "--json", "--plot", str(png))) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"params", "events", "summary"}
    assert out["params"]["policy"] == "snapkv" and out["params"]["window"] == 4 and out["params"]["evict_every"] == 4
    assert len(out["events"]) == 5 and 0.0 < out["summary"]["fmm_mean"] < 1.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = tmp_path / "diag.json"
    saved.write_text(json.dumps(out))
    both = tmp_path / "both.png"
    plot([load_result(str(saved)), load_result(str(saved))], str(both))  # policies side by side
    assert both.read_bytes()[:4] == b"\x89PNG"
    assert cli.main(_cli_args(text_file)) == 0
    assert "FMM mean" in capsys.readouterr().out


def test_cli_checks_arguments_before_loading(text_file, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(cli, "_load", refuse)
    assert cli.main(_cli_args(text_file, "--int2-share", "0.7")) == 2
    assert "--int2-share needs --tiers" in capsys.readouterr().err
    assert cli.main(_cli_args(text_file, "--horizon", "0")) == 2
    assert "--horizon must be >= 1" in capsys.readouterr().err
    assert cli.main(_cli_args(text_file, "--evict-every", "0")) == 2
    assert "--evict-every must be >= 1" in capsys.readouterr().err

    assert cli.main(_cli_args(text_file, "--tiers", "int2", "--int2-share", "1.0")) == 2
    assert "int2_share must be in [0, 1)" in capsys.readouterr().err


def test_a_setting_make_cache_refuses_fails_before_the_reference_pass(tiny, text_file, monkeypatch):
    import vlm_kv.eval.diagnostics as diag

    def no_reference(*args, **kwargs):
        raise AssertionError("the full-cache pass ran before the cache settings were checked")

    monkeypatch.setattr(diag, "reference_attention", no_reference)
    model, tok = tiny
    with pytest.raises(ValueError, match="retention gates"):  # dbtrimkv has no gates for the tiny model
        diagnose(model, tok, str(text_file), "dbtrimkv", 0.5, context=48, continuation=8)


def test_cli_forwards_tier_settings_to_the_cache(tiny, text_file, monkeypatch, capsys):
    seen = {}

    def tiered_make_cache(model, policy="snapkv", budget=0.25, *, tiers=None, options=None):
        seen.update(policy=policy, budget=budget, evict_every=options.evict_every, tiers=tiers)
        raise ValueError("stop here")

    # the runner builds its cache through make_cache
    monkeypatch.setattr("vlm_kv.eval.diagnostics.make_cache", tiered_make_cache)
    monkeypatch.setattr(cli, "_load", lambda *args, **kwargs: tiny)
    assert cli.main(_cli_args(text_file, "--tiers", "int2", "--int2-share", "0.5")) == 2
    assert "stop here" in capsys.readouterr().err
    assert seen == dict(policy="snapkv", budget=0.5, evict_every=4, tiers={"int2_share": 0.5, "window": 4})


# ----------------------------------------------------------------------------- sweep columns


def test_fidelity_sweep_with_diagnostics_adds_fmm_and_churn_columns(tiny, text_file, tmp_path):
    from vlm_kv.eval import sweep as sw

    model, tok = tiny
    task = sw.FidelityTask(model, tok, str(text_file), 48, 40, model_name="tiny-llama",
                           cache_kwargs={"options": CacheOptions(evict_every=4)}, diagnostics=True)
    result = sw.run_sweep(task, ["h2o"], [0.3, 1.0], tmp_path, progress=False, plots=False)
    assert result.errors == []
    rows = {r["budget"]: r for r in result.rows}
    assert rows[1.0]["fmm"] == 0.0 and rows[1.0]["churn"] == 0.0 and rows[1.0]["kl"] == pytest.approx(0.0, abs=1e-4)
    small = rows[0.3]
    assert 0.0 < small["fmm"] <= small["fmm_tokens"] < 1.0 and 0.0 <= small["churn"] <= 1.0
    assert small["lir"] == 0.0 and small["lir_runs"] > 0  # 40 steps: events at 0 ... 8 see the whole horizon
    assert result.reference["fmm"] == 0.0
    header = result.csv_path.read_text().splitlines()[0].split(",")
    assert header[:6] == ["policy", "budget", "kl", "top1", "fmm", "churn"]
    settings = json.loads(result.json_path.read_text())["settings"]
    assert settings["diagnostics"] == {"window": 8, "horizon": 32, "lir_m": 2}
    # the cell's FMM is the one `diagnose` measures on the same tokens with the same cache settings
    direct = diagnose(model, tok, str(text_file), "h2o", 0.3, context=48, continuation=40,
                      options=CacheOptions(evict_every=4))
    assert small["fmm"] == pytest.approx(direct.summary["fmm_mean"])
    assert small["churn"] == pytest.approx(direct.summary["churn_mean"])


def test_sweep_diagnostics_only_for_fidelity():
    from vlm_kv.eval.sweep_cli import build_task

    args = cli.build_parser().parse_args(["sweep", "--task", "retrieval", "--policies", "snapkv", "--budgets", "0.5",
                                          "--out", "x", "--text", "t.txt", "--diagnostics"])
    with pytest.raises(ValueError, match="--diagnostics is for --task fidelity"):
        build_task(args)


def test_runner_on_a_bfloat16_model(text_file):
    model, tok = tiny_model("llama", dtype=torch.bfloat16, num_layers=1), tiny_tokenizer("llama")
    result = diagnose(model, tok, str(text_file), "snapkv", 0.5, context=40, continuation=8, horizon=4,
                      window=4, options=CacheOptions(evict_every=4))
    assert [e["step"] for e in result.events] == [0, 4, 8]
    assert 0.0 < result.summary["fmm_mean"] < 1.0 and result.summary["fmm_events"] == 2
