"""Policies x budgets sweeps (vlm_kv.eval.sweep) and planted-fact retrieval on tiny random models."""

import argparse
import csv
import json

import pytest
import torch

import vlm_kv
from vlm_kv.eval import sweep as sw
from vlm_kv.eval import sweep_cli
from vlm_kv.eval.retrieval import RetrievalSettings, build_trials, retrieval, score_answer
from vlm_kv.testing import tiny_model, tiny_tokenizer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
POLICIES = ["snapkv", "streaming_llm"]
BUDGETS = [0.5, 0.75]  # the tiny contexts are short: snapkv always keeps a 32-token window


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama"), tiny_tokenizer("llama")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    colors = ["red", "green", "blue", "grey", "white"]
    things = ["house", "river", "letter", "mountain", "ship"]
    sentences = [f"On day {i} the {colors[i % 5]} {things[(i * 3) % 5]} was seen again by the traveller."
                 for i in range(120)]
    path = tmp_path_factory.mktemp("text") / "story.txt"
    path.write_text(" ".join(sentences) + "\n", encoding="utf-8")
    return str(path)


def _fidelity_task(tiny, text_file):
    model, tok = tiny
    return sw.FidelityTask(model, tok, text_file, 96, 12, offset=0, model_name="tiny-llama")


def _csv_rows(path):
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.reader(fh))


def test_fidelity_sweep_writes_table_plots_and_resumes(tiny, text_file, tmp_path, monkeypatch):
    task = _fidelity_task(tiny, text_file)
    result = sw.run_sweep(task, POLICIES, BUDGETS, tmp_path, progress=False)

    assert (result.n_run, result.n_skipped, result.errors) == (4, 0, [])
    lines = _csv_rows(result.csv_path)
    assert len(lines) == 5  # header + one row per (policy, budget)
    header = lines[0]
    assert header[:4] == ["policy", "budget", "kl", "top1"] and "kv_bytes_at_end" in header and "error" in header
    assert {(r[0], float(r[1])) for r in lines[1:]} == {(p, b) for p in POLICIES for b in BUDGETS}

    table = json.loads(result.json_path.read_text())
    assert table["task"] == "fidelity" and table["settings"]["context"] == 96
    ref = table["reference"]
    assert ref["policy"] == "full" and ref["kl"] == 0.0 and ref["top1"] == 1.0
    assert len(table["rows"]) == 4
    for row in table["rows"]:
        assert row["error"] is None
        assert row["kl"] >= 0 and 0 <= row["top1"] <= 1
        assert row["full_kv_bytes_at_end"] == ref["kv_bytes_at_end"]
        assert 0 < row["kv_bytes_at_end"] < row["full_kv_bytes_at_end"]
        assert row["kv_fraction_at_end"] == pytest.approx(row["kv_bytes_at_end"] / row["full_kv_bytes_at_end"])
    by = {(r["policy"], r["budget"]): r for r in table["rows"]}
    assert by[("snapkv", 0.5)]["kv_bytes_at_end"] < by[("snapkv", 0.75)]["kv_bytes_at_end"]

    names = sorted(p.name for p in result.plots)
    assert names == sorted(f"sweep_fidelity_{m}_vs_{a}.png" for m in ("kl", "top1") for a in ("budget", "kv_bytes"))
    for p in result.plots:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000

    # rerun: every row is already in the JSON, nothing runs (not even the reference)
    def boom(*a, **k):
        raise AssertionError("a finished cell ran again")

    again = _fidelity_task(tiny, text_file)
    monkeypatch.setattr(again, "run", boom)
    monkeypatch.setattr(again, "reference", boom)
    second = sw.run_sweep(again, POLICIES, BUDGETS, tmp_path, progress=False)
    assert (second.n_run, second.n_skipped) == (0, 4)
    assert json.loads(second.json_path.read_text())["rows"] == table["rows"]

    # a larger grid runs only the new cells
    ran = []
    grow = _fidelity_task(tiny, text_file)
    real_run = grow.run
    monkeypatch.setattr(grow, "run", lambda p, b: ran.append((p, b)) or real_run(p, b))
    third = sw.run_sweep(grow, POLICIES, BUDGETS + [1.0], tmp_path, progress=False, plots=False)
    assert ran == [("snapkv", 1.0), ("streaming_llm", 1.0)] and third.n_skipped == 4
    assert len(_csv_rows(third.csv_path)) == 7


class FakeTask:
    """A task without a model: exercises the sweep bookkeeping alone."""

    name = "fake"
    metrics = (sw.Metric("score", "fake score"),)

    def __init__(self, knob=1, gated_ok=False):
        self.knob, self.gated_ok, self.calls = knob, gated_ok, []

    def settings(self):
        return {"knob": self.knob}

    def reference(self):
        return {"score": 1.0, "kv_bytes": 1000}

    def run(self, policy, budget):
        self.calls.append((policy, budget))
        if policy == "trimkv" and not self.gated_ok:
            raise ValueError("policy 'trimkv' needs retention gates for this model")
        return {"score": budget, "kv_bytes": int(1000 * budget), "extra": {"nested": 1}}


def test_value_errors_become_error_rows_and_are_retried(tmp_path):
    task = FakeTask()
    res = sw.run_sweep(task, ["snapkv", "trimkv"], [0.1, 0.5], tmp_path, progress=False)
    assert [k for k, _ in res.errors] == ["trimkv@0.1", "trimkv@0.5"]
    rows = {(r["policy"], r["budget"]): r for r in res.rows}
    assert "gates" in rows[("trimkv", 0.1)]["error"] and rows[("trimkv", 0.1)]["score"] is None
    assert rows[("snapkv", 0.5)]["kv_fraction_at_end"] == pytest.approx(0.5)
    lines = _csv_rows(res.csv_path)
    assert len(lines) == 5 and "extra" not in lines[0]  # nested values stay in the JSON only

    fixed = FakeTask(gated_ok=True)
    res2 = sw.run_sweep(fixed, ["snapkv", "trimkv"], [0.1, 0.5], tmp_path, progress=False)
    assert fixed.calls == [("trimkv", 0.1), ("trimkv", 0.5)] and res2.errors == []


def test_resume_with_other_settings_is_refused(tmp_path):
    sw.run_sweep(FakeTask(knob=1), ["snapkv"], [0.5], tmp_path, progress=False, plots=False)
    with pytest.raises(ValueError, match="other settings"):
        sw.run_sweep(FakeTask(knob=2), ["snapkv"], [0.5], tmp_path, progress=False, plots=False)


def test_int_and_float_budgets_are_distinct_rows(tmp_path):
    res = sw.run_sweep(FakeTask(), ["snapkv"], [1.0, 64], tmp_path, progress=False, plots=False)
    assert [r["budget"] for r in res.rows] == [1.0, 64]
    assert sw.budget_key("snapkv", 64) != sw.budget_key("snapkv", 64.0)


def test_score_answer_exact_match():
    assert score_answer("4821", "4821")
    assert score_answer("The secret code is 4,821.", "4821")
    assert not score_answer("48210", "4821")
    assert not score_answer("It is 1234, not 4821", "4821")  # the first number counts
    assert not score_answer("", "4821")


def test_trials_plant_the_fact_at_the_requested_depth(tiny, text_file):
    _, tok = tiny
    settings = RetrievalSettings(400, depths=(0.0, 0.5, 1.0), trials=2, seed=3)
    specs = build_trials(tok, text_file, settings)
    assert len(specs) == 6 and len({s["text_offset"] for s in specs}) == 2
    for s in specs:
        fact = f"The secret code of the {s['key']} is {s['code']}."
        assert s["document"].count(fact) == 1 and len(s["code"]) == 4
        where = s["document"].index(fact) / len(s["document"])
        assert abs(where - s["depth"]) < 0.25
    assert specs[0]["document"].startswith("The secret code")
    assert specs[2]["document"].endswith(f"{specs[2]['code']}.")
    assert specs == build_trials(tok, text_file, settings)


def test_retrieval_on_tiny_model(tiny, text_file):
    model, tok = tiny
    settings = RetrievalSettings(96, depths=(0.2, 0.8), trials=2, max_new_tokens=4)
    full = retrieval(model, tok, text_file, "full", 1.0, settings)
    res = retrieval(model, tok, text_file, "streaming_llm", 0.5, settings, reference=full)
    for key in ("accuracy", "full_accuracy", "relative_accuracy", "retained", "agreement", "by_depth",
                "full_by_depth", "kv_bytes", "max_kv_bytes", "full_kv_bytes", "prompt_tokens", "records"):
        assert key in res
    for r in (full, res):
        assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["full_accuracy"] <= 1.0
        assert 0.0 <= r["agreement"] <= 1.0 and len(r["records"]) == 4
    assert full["agreement"] == 1.0 and full["accuracy"] == full["full_accuracy"]
    assert [r["full_answer"] for r in res["records"]] == [r["answer"] for r in full["records"]]
    assert set(res["by_depth"]) == {"0.2", "0.8"}
    assert res["kv_bytes"] < res["full_kv_bytes"]
    with pytest.raises(ValueError, match="other settings"):
        retrieval(model, tok, text_file, "streaming_llm", 0.5, RetrievalSettings(96, depths=(0.2,), trials=2),
                  reference=full)
    with pytest.raises(ValueError, match="other settings"):  # asked later: other prompts
        retrieval(model, tok, text_file, "streaming_llm", 0.5,
                  RetrievalSettings(96, depths=(0.2, 0.8), trials=2, max_new_tokens=4, ask="later"), reference=full)


def test_every_task_reports_the_kv_columns_with_one_definition(tiny, text_file, tmp_path):
    # fidelity and retrieval tables: the same columns, and "after eviction" is what the budget
    # bounds in both (the bytes at the end carry the tokens fed since the last eviction step)
    from vlm_kv.eval.sweep_table import KV_COLUMNS

    model, tok = tiny
    budget = 0.25
    tasks = [_fidelity_task(tiny, text_file),
             sw.RetrievalTask(model, tok, text_file, RetrievalSettings(96, depths=(0.5,), trials=2, max_new_tokens=12))]
    for task in tasks:
        result = sw.run_sweep(task, ["streaming_llm"], [budget], tmp_path / task.name, progress=False, plots=False)
        header = _csv_rows(result.csv_path)[0]
        assert all(column in header for column in KV_COLUMNS), header
        (row,) = result.rows
        assert row["max_kv_bytes_after_eviction"] <= budget * row["full_kv_bytes_at_end"]
        assert row["kv_bytes_at_end"] > row["max_kv_bytes_after_eviction"]  # decoded since the last step
    for record in row["records"]:  # retrieval: every trial's own cache, against its own full cache
        assert record["max_kv_bytes"] <= budget * record["full_kv_bytes"]


def test_sweep_cli_runs_a_retrieval_sweep(tiny, text_file, tmp_path, monkeypatch, capsys):
    parser = argparse.ArgumentParser(prog="vlm-kv")
    sub = parser.add_subparsers(dest="command", required=True)
    sweep_cli.register(sub)
    monkeypatch.setattr(sweep_cli, "_text_model", lambda args: tiny)
    out = tmp_path / "cli"
    args = parser.parse_args(["sweep", "--task", "retrieval", "--model", "tiny", "--text", text_file,
                              "--context", "96", "--depths", "0.5", "--trials", "1", "--max-new-tokens", "3",
                              "--policies", "streaming_llm,trimkv", "--budgets", "0.5", "--out", str(out),
                              "--no-progress"])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    assert "streaming_llm" in captured.out and "trimkv@0.5" in captured.err  # no gates: an error row
    table = json.loads((out / "sweep_retrieval.json").read_text())
    assert [r["policy"] for r in table["rows"]] == ["streaming_llm", "trimkv"]
    assert table["reference"]["records"] and 0 <= table["rows"][0]["accuracy"] <= 1
    assert (out / "sweep_retrieval_accuracy_vs_kv_bytes.png").read_bytes()[:8] == PNG_MAGIC

    with pytest.raises(SystemExit):
        parser.parse_args(["sweep", "--task", "fidelity", "--policies", "nope", "--budgets", "0.5", "--out", "x"])
    bad = parser.parse_args(["sweep", "--task", "fidelity", "--policies", "snapkv", "--budgets", "0.5",
                             "--out", str(out)])
    with pytest.raises(ValueError, match="--text"):
        bad.func(bad)


def test_sweep_refuses_full_and_bad_cells_before_loading(text_file, tmp_path, monkeypatch, capsys):
    parser = argparse.ArgumentParser(prog="vlm-kv")
    sweep_cli.register(parser.add_subparsers(dest="command"))
    monkeypatch.setattr(sweep_cli, "_text_model", lambda args: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit):  # the reference row is the full cache, at budget 1.0 only
        parser.parse_args(["sweep", "--task", "fidelity", "--policies", "full,snapkv", "--budgets", "0.1",
                           "--out", "x"])
    assert "'full' is every sweep's reference row" in capsys.readouterr().err
    args = parser.parse_args(["sweep", "--task", "fidelity", "--text", text_file, "--policies", "snapkv,kivi2",
                              "--budgets", "0.5", "--out", str(tmp_path / "s")])
    with pytest.raises(vlm_kv.BudgetError, match="'kivi2' keeps what its own rule says"):
        args.func(args)


@pytest.fixture(scope="module")
def tiny_vlm():
    from vlm_kv.testing import tiny_processor

    return tiny_model("qwen2_5_vl"), tiny_processor("qwen2_5_vl")


def test_mathvision_sweep_on_a_tiny_vlm(tiny_vlm, shared_data, tmp_path):
    from vlm_kv.eval.mathvision_data import load_problems

    problems = load_problems(shared_data / "mathvision", split="testmini", limit=2)
    loads = []
    task = sw.MathVisionTask(lambda: loads.append(1) or tiny_vlm, problems, tmp_path, max_new_tokens=3,
                             model_name="tiny-qwen")
    res = sw.run_sweep(task, ["streaming_llm"], [0.5, 48], tmp_path, progress=False)
    assert res.errors == [] and len(loads) == 1
    ref = res.reference
    assert ref["n_problems"] == 2 and ref["accuracy_all"].startswith(f"{ref['n_correct']}/2=")
    assert (tmp_path / "mathvision" / "full_1.0" / "mathvision_result.json").exists()
    for row in res.rows:
        assert 0 <= row["accuracy"] <= 1 and 0 < row["kv_bytes_at_end"] < ref["kv_bytes_at_end"] == row["full_kv_bytes_at_end"]
    assert len(_csv_rows(res.csv_path)) == 3
    assert {p.name for p in res.plots} == {"sweep_mathvision_accuracy_vs_budget.png",
                                           "sweep_mathvision_accuracy_vs_kv_bytes.png"}


def test_mmdu_sweep_answers_then_judges_every_cell(tiny_vlm, tmp_path):
    from PIL import Image

    from vlm_kv.eval.mmdu_data import load_mmdu

    (tmp_path / "pics").mkdir()
    for k in range(2):
        Image.new("RGB", (24, 20), (60 * k, 120, 200)).save(tmp_path / "pics" / f"{k}.png")
    bench = {"7": {"id": 7, "image": ["pics/0.png", "pics/1.png"], "conversations": [
        {"from": "user", "value": "<ImageHere>What colour is the background of this picture? Explain in detail."},
        {"from": "assistant", "value": "It is blue."},
        {"from": "user", "value": "And in <ImageHere>? Compare both pictures and say which is darker."},
        {"from": "assistant", "value": "Also blue, a bit darker."}]}}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    data = load_mmdu(tmp_path / "bench.json", tmp_path)
    prompts = []

    def judge(prompt):
        prompts.append(prompt)
        return ("Fine. {'Creativity': 6, 'Richness': 7, 'Visual Perception': 5, 'Logical Coherence': 8, "
                "'Answer Accuracy': 7, 'Image Relationship Understanding': 4, 'Overall Score': 6}")

    out = tmp_path / "out"
    no_judge = sw.MMDUTask(lambda: tiny_vlm, data, out, judge=None, max_new_tokens=3, model_name="tiny-qwen")
    first = sw.run_sweep(no_judge, ["snapkv"], [48], out, progress=False, plots=False)
    assert [m.key for m in no_judge.metrics] == ["rouge_l"] and first.rows[0]["overall"] is None
    assert first.reference["kv_bytes_at_end"] > first.rows[0]["kv_bytes_at_end"] > 0  # the full cache is metered too

    # same folder, now with a judge: nothing is generated again, every cell (and the reference) is judged
    judged = sw.MMDUTask(lambda: pytest.fail("the answering model is not needed"), data, out, judge=judge,
                         max_new_tokens=3, model_name="tiny-qwen")
    res = sw.run_sweep(judged, ["snapkv"], [48], out, progress=False)
    assert res.n_run == 0 and len(prompts) == 4  # 2 questions x (reference + 1 cell)
    for row in (res.reference, *res.rows):
        assert row["judged"] is True and row["overall"] == pytest.approx(60.0) and 0 <= row["rouge_l"] <= 1
    assert {p.name for p in res.plots} >= {"sweep_mmdu_overall_vs_kv_bytes.png", "sweep_mmdu_rouge_l_vs_budget.png"}


def test_retrieval_asked_later_prefills_the_document_before_the_question(tiny, text_file, monkeypatch):
    from vlm_kv.eval import retrieval as R

    model, tok = tiny
    settings = RetrievalSettings(96, depths=(0.5,), trials=1, max_new_tokens=4, ask="later")
    (spec,) = build_trials(tok, text_file, settings)
    ids = R._prompt_ids(tok, spec, "later")
    n = ids["context_ids"].shape[1]
    assert torch.equal(ids["input_ids"][:, :n], ids["context_ids"])
    assert spec["question"] in tok.decode(ids["input_ids"][0, n:]) and spec["question"] not in tok.decode(ids["context_ids"][0])
    # the compressed cache chooses before the question exists: the first forward sees the document turn only
    seen = []
    real_forward = model.forward

    def recording(*args, **kwargs):
        seen.append(kwargs["input_ids"].shape[1])
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", recording)
    res = retrieval(model, tok, text_file, "streaming_llm", 0.5, settings)
    assert seen[0] == n and seen[1] == ids["input_ids"].shape[1] - n  # then only the question turn is prefilled
    assert res["ask"] == "later" and res["kv_bytes"] < res["full_kv_bytes"]
    with pytest.raises(ValueError, match="ask must be one of"):
        RetrievalSettings(96, ask="sometime")


def test_retrieval_runs_kvzip_through_its_reconstruction_pass(tiny, text_file):
    model, tok = tiny
    for ask in ("prompt", "later"):
        settings = RetrievalSettings(96, depths=(0.5,), trials=1, max_new_tokens=3, ask=ask)
        res = retrieval(model, tok, text_file, "kvzip", 0.5, settings)
        assert res["kv_bytes"] < res["full_kv_bytes"] and res["records"][0]["answer"] is not None


def test_sweep_scorer_kwargs_reach_the_caches_and_bad_ones_are_refused_before_loading(text_file, tmp_path,
                                                                                   monkeypatch):
    parser = argparse.ArgumentParser(prog="vlm-kv")
    sweep_cli.register(parser.add_subparsers(dest="command"))
    base = ["sweep", "--task", "retrieval", "--text", text_file, "--policies", "streaming_llm", "--budgets", "0.5",
            "--out", str(tmp_path / "s")]
    kw = sweep_cli._cache_kwargs(parser.parse_args([*base, "--scorer-kwargs", '{"num_sinks": 2}']))
    assert kw["options"].scorer_kwargs == {"num_sinks": 2}
    assert "options" not in sweep_cli._cache_kwargs(parser.parse_args(base))
    monkeypatch.setattr(sweep_cli, "_text_model", lambda args: pytest.fail("the model was loaded"))
    for bad, said in (("{oops", "--scorer-kwargs is not JSON"), ("[5]", "JSON object of the scorer's fields"),
                      ('{"spann": 5}', "spann")):
        args = parser.parse_args([*base, "--scorer-kwargs", bad])
        with pytest.raises((ValueError, TypeError), match=said):
            args.func(args)
