"""MathVision prompts (authors' / lmms-eval) and the generation runner end to end on tiny
random VLMs with the real processors and vlm_kv caches (resume, per-item errors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import vlm_kv
from vlm_kv.eval.mathvision_data import load_problems
from vlm_kv.eval.mathvision_prompt import (
    AUTHORS_INSTRUCTION,
    LMMS_EVAL_INSTRUCTION,
    build_messages,
    build_prompt,
)
from vlm_kv.eval.mathvision_run import (
    CONFIG_FILE,
    RESPONSES_FILE,
    RESULT_FILE,
    SUMMARY_FILE,
    load_rows,
    run_mathvision,
)
from vlm_kv.testing import tiny_model, tiny_processor

MV = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mathvision"

FREE = {"question": "How many bricks are missing?\n<image1>", "options": []}
MC_TEXT = {"question": "Which is largest?\n<image1>", "options": ["$1$", "$2$", "$3$", "$4$", "$5$"]}
MC_LETTERS = {"question": "Which picture?\n<image1>", "options": ["A", "B", "C", "D", "E"]}


# ----------------------------------------------------------------------------- prompts


def test_authors_prompt_exact_text():
    head = ('Please solve the problem step by step and put your answer in one "\\boxed{}". '
            'If it is a multiple choice question, only one letter is allowed in the "\\boxed{}".')
    assert AUTHORS_INSTRUCTION == head
    assert build_prompt(FREE) == head + "\nHow many bricks are missing?\n<image1>\n"
    assert build_prompt(MC_TEXT) == (
        head + "\nWhich is largest?\n<image1>\n(A) $1$\n(B) $2$\n(C) $3$\n(D) $4$\n(E) $5$\n")
    # options that are only the letters are not listed
    assert build_prompt(MC_LETTERS) == head + "\nWhich picture?\n<image1>\n"
    assert build_prompt(MC_TEXT, "authors") == build_prompt(MC_TEXT)


def test_lmms_eval_prompt_exact_text():
    head = 'Please solve the problem step by step and put your answer in one "\\boxed{}".'
    assert LMMS_EVAL_INSTRUCTION == head
    assert build_prompt(FREE, "lmms-eval") == head + "How many bricks are missing?\n<image1>"
    assert build_prompt(MC_TEXT, "lmms-eval") == (
        head + "Which is largest?\n<image1>\nChoices: A. $1$\nB. $2$\nC. $3$\nD. $4$\nE. $5$"
        "\nAnswer the question with the option's letter from the given choices directly.")
    assert build_prompt(MC_LETTERS, "lmms-eval").endswith(
        "Choices: A. A\nB. B\nC. C\nD. D\nE. E\nAnswer the question with the option's letter "
        "from the given choices directly.")


def test_unknown_prompt_style_is_refused():
    with pytest.raises(ValueError, match="lmms-eval"):
        build_prompt(FREE, "cot")


def test_messages_structure_and_real_problem_objects():
    problem = load_problems(MV, limit=3)[2]  # id 6, options A-E
    msgs = build_messages(problem, "lmms-eval")
    assert msgs == [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": build_prompt(problem, "lmms-eval")}]}]
    assert "Choices: A. A" in msgs[0]["content"][1]["text"]


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_messages_render_with_vlm_chat_templates(family):
    processor = tiny_processor(family)
    problem = load_problems(MV, limit=1)[0]
    text = processor.apply_chat_template(build_messages(problem), tokenize=False, add_generation_prompt=True)
    assert build_prompt(problem) in text
    image_marker = "<|image_pad|>" if family == "qwen2_vl" else "<image>"
    assert text.count(image_marker) == 1
    assert text.index(image_marker) < text.index("Please solve")
    inputs = processor(text=[text], images=[problem.load_image()], return_tensors="pt")
    assert inputs["input_ids"].shape[0] == 1 and "pixel_values" in inputs


# ----------------------------------------------------------------------------- runner


@pytest.fixture(scope="module")
def qwen():
    return tiny_model("qwen2_vl"), tiny_processor("qwen2_vl")


def _problems(tmp_path, n=3):
    """n testmini problems plus one whose image is missing."""
    src = [json.loads(line) for line in (MV / "testmini.jsonl").read_text(encoding="utf-8").splitlines()[:n]]
    for row in src:
        row["image"] = str(MV / row["image"])
    missing = dict(src[0], id="missing-image", image=str(tmp_path / "nope.jpg"))
    path = tmp_path / "problems.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [*src, missing]) + "\n", encoding="utf-8")
    return load_problems(path)


def test_runner_writes_rows_result_and_resumes(tmp_path, qwen):
    model, processor = qwen
    problems = _problems(tmp_path)
    assert problems.n_errors == 1
    out = tmp_path / "run"
    calls = []

    def counting_make_cache(m, policy, budget, **kw):
        calls.append((policy, budget))
        return vlm_kv.make_cache(m, policy=policy, budget=budget, **kw)

    summary = run_mathvision(model, processor, problems, policy="snapkv", budget=40, out_dir=out,
                             max_new_tokens=6, make_cache=counting_make_cache, progress=False)
    rows, bad = load_rows(out / RESPONSES_FILE)
    assert bad == 0 and [r["id"] for r in rows] == ["4", "5", "6", "missing-image"]
    # a fresh cache per generated problem (+ one settings check up front)
    assert calls == [("snapkv", 40)] * 4
    for r in rows[:3]:
        assert r["error"] is None and isinstance(r["response"], str)
        assert 1 <= r["n_new_tokens"] <= 6 and r["truncated"] is (r["n_new_tokens"] == 6)
        assert r["n_input_tokens"] > 16  # prompt text + image tokens
        assert set(r) >= {"id", "response", "extracted", "correct", "error"}
    assert rows[3]["error_kind"] == "data" and "image not found" in rows[3]["error"]
    assert summary.n_problems == 4 and summary.n_errors == 1 and summary.n_generated == 4
    result = json.loads((out / RESULT_FILE).read_text(encoding="utf-8"))
    assert result["-all"].startswith(f"{summary.n_correct}/4=")
    assert result == summary.result
    assert json.loads((out / SUMMARY_FILE).read_text(encoding="utf-8"))["errors_by_kind"] == {"data": 1}
    assert json.loads((out / CONFIG_FILE).read_text(encoding="utf-8"))["prompt"] == "authors"

    # rerun: everything is skipped, nothing is generated, no cache is made
    calls.clear()
    again = run_mathvision(model, processor, problems, policy="snapkv", budget=40, out_dir=out,
                           max_new_tokens=6, make_cache=counting_make_cache, progress=False)
    assert (again.n_generated, again.n_skipped) == (0, 4) and calls == []
    assert again.result == summary.result
    assert len(load_rows(out / RESPONSES_FILE)[0]) == 4

    # other settings in the same folder are refused
    with pytest.raises(ValueError, match="budget"):
        run_mathvision(model, processor, problems, policy="snapkv", budget=0.5, out_dir=out,
                       max_new_tokens=6, progress=False)


def test_runner_records_generation_failures_and_torn_lines(tmp_path, qwen, monkeypatch):
    model, processor = qwen
    problems = _problems(tmp_path, n=3)
    out = tmp_path / "run"
    real_generate = model.generate
    n_calls = {"n": 0}

    def flaky_generate(*args, **kwargs):
        n_calls["n"] += 1
        if n_calls["n"] == 2:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", flaky_generate)
    summary = run_mathvision(model, processor, problems, policy="full", budget=1.0, out_dir=out,
                             prompt_style="lmms-eval", max_new_tokens=4, progress=False)
    rows = {r["id"]: r for r in load_rows(out / RESPONSES_FILE)[0]}
    assert rows["5"]["error_kind"] == "generation" and "out of memory" in rows["5"]["error"]
    assert rows["5"]["response"] is None and rows["5"]["correct"] is False
    assert rows["4"]["error"] is None and rows["6"]["error"] is None
    assert summary.n_errors == 2 and summary.n_generated == 4

    # simulate a crash mid-write, then retry the failed problems
    with open(out / RESPONSES_FILE, "a", encoding="utf-8") as fh:
        fh.write('{"id": "6", "respo')
    retried = run_mathvision(model, processor, problems, policy="full", budget=1.0, out_dir=out,
                             prompt_style="lmms-eval", max_new_tokens=4, retry_errors=True, progress=False)
    rows_after, bad = load_rows(out / RESPONSES_FILE)
    assert bad == 0  # the torn line was dropped
    # the generation failure and the (still) missing image are tried again
    assert retried.n_generated == 2 and retried.n_skipped == 2
    latest = {r["id"]: r for r in rows_after}
    assert latest["5"]["error"] is None and isinstance(latest["5"]["response"], str)
    assert latest["missing-image"]["error_kind"] == "data"
    assert retried.n_errors == 1


def test_runner_refuses_bad_cache_settings_before_writing(tmp_path, qwen):
    model, processor = qwen
    problems = _problems(tmp_path, n=1)
    with pytest.raises(vlm_kv.BudgetError):
        run_mathvision(model, processor, problems, policy="streaming_llm", budget=2, out_dir=tmp_path / "run",
                       max_new_tokens=4, progress=False)
    assert not (tmp_path / "run" / RESPONSES_FILE).exists() or not load_rows(tmp_path / "run" / RESPONSES_FILE)[0]


def test_runner_reports_repeated_ids_once(tmp_path, qwen):
    model, processor = qwen
    row = json.loads((MV / "testmini.jsonl").read_text(encoding="utf-8").splitlines()[0])
    row["image"] = str(MV / row["image"])
    path = tmp_path / "dup.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n", encoding="utf-8")
    problems = load_problems(path)
    assert len(problems) == 2 and problems.n_errors == 1
    summary = run_mathvision(model, processor, problems, policy="full", budget=1.0, out_dir=tmp_path / "run",
                             max_new_tokens=2, progress=False)
    rows = load_rows(tmp_path / "run" / RESPONSES_FILE)[0]
    assert [r["id"] for r in rows] == ["4"] and rows[0]["error"] is None
    assert summary.n_problems == 2 and summary.n_errors == 1 and "repeated id" in summary.errors[0][1]
    assert summary.result["-all"] in ("0/1=0.0%", "1/1=100.0%")  # the problem counts once
    saved = json.loads((tmp_path / "run" / SUMMARY_FILE).read_text(encoding="utf-8"))
    assert saved["errors_by_kind"] == {"repeated_id": 1} and saved["not_in_aggregate"] == 1
