"""MMDU runner end to end on tiny random models: multi-turn on one cache, judging, resume, CLI."""

import argparse
import json
import shutil

import pytest
import torch
from PIL import Image, ImageDraw
from transformers import LogitsProcessor, LogitsProcessorList

import vlm_kv
from vlm_kv.eval import mmdu_cli
from vlm_kv.eval.mmdu_data import load_mmdu
from vlm_kv.eval.mmdu_judge import LocalJudge
from vlm_kv.eval.mmdu_run import (
    ANSWERS_FILE,
    JUDGED_FILE,
    SUMMARY_FILE,
    CacheStateError,
    DialogRunner,
    generate_answers,
    judge_answers,
    load_finished,
    run_mmdu,
    summarize,
)
from vlm_kv.testing import tiny_model, tiny_processor

POLICY, BUDGET = "snapkv", 40  # 40 tokens per KV head: the tiny dialogs are longer, so it evicts


def _draw(path, k):
    im = Image.new("RGB", (24 + 8 * (k % 3), 20 + 6 * (k % 2)), (40 * k % 256, 120, 200 - 25 * k))
    d = ImageDraw.Draw(im)
    d.ellipse((2, 2, 14, 14), fill=(255, 255, 0))
    d.rectangle((10, 8, 20, 18), outline=(0, 0, 0))
    im.save(path)


def _u(v):
    return {"from": "user", "value": v}


def _a(v):
    return {"from": "assistant", "value": v}


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    """3 dialogs in MMDU format; the last one lists an image that is not on disk."""
    root = tmp_path_factory.mktemp("mmdu")
    (root / "pics").mkdir()
    for k in range(6):
        _draw(root / "pics" / f"{k}.png", k)
    bench = {
        "101": {
            "id": 101,
            "image": [f"/data/mmdu/pics/{k}.png" for k in range(3)],
            "conversations": [
                _u("<ImageHere><ImageHere>What differs between these two pictures?"), _a("The first is darker."),
                _u("Here is one more: <ImageHere>. Which is brightest?"), _a("The third one."),
                _u("Summarize the three images."), _a("Three shapes on coloured backgrounds."),
            ],
        },
        "102": {
            "id": 102,
            "image": ["pics/3.png"],
            "conversations": [_u("Describe <ImageHere> briefly."), _a("A yellow circle and a square.")],
        },
        "103": {
            "id": 103,
            "image": ["pics/4.png", "pics/missing.png"],
            "conversations": [
                _u("<ImageHere>What colour is the circle?"), _a("Yellow."),
                _u("And in <ImageHere>?"), _a("Also yellow."),
                _u("Thanks."), _a("You are welcome."),
            ],
        },
    }
    (root / "benchmark.json").write_text(json.dumps(bench), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def vlm():
    return tiny_model("qwen2_5_vl", seed=0), tiny_processor("qwen2_5_vl")


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    """A tiny random chat model + a tokenizer with a chat template, saved as one local folder."""
    path = tmp_path_factory.mktemp("tiny-judge")
    tiny_model("qwen2", seed=1).save_pretrained(path)
    tiny_processor("qwen2_5_vl").tokenizer.save_pretrained(path)
    return path


def _counting_factory(calls):
    def factory(model, policy, budget, **kw):
        calls.append(policy)
        return vlm_kv.make_cache(model, policy=policy, budget=budget, **kw)

    return factory


class _CountingJudge:
    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def info(self):
        return self.inner.info()

    def __call__(self, prompt):
        self.calls += 1
        return self.inner(prompt)


def test_end_to_end_local_judge_compressed_cache_and_resume(fixture_dir, vlm, judge_dir, tmp_path):
    model, processor = vlm
    data = load_mmdu(fixture_dir / "benchmark.json", fixture_dir)
    assert data.problem_counts() == {"missing_image": 1}
    judge = _CountingJudge(LocalJudge(judge_dir, max_new_tokens=12))
    out = tmp_path / "run"
    calls = []
    summary = run_mmdu(
        model, processor, data, out, policy=POLICY, budget=BUDGET, judge=judge, max_new_tokens=6,
        config={"model": "tiny-qwen2_5_vl"}, cache_factory=_counting_factory(calls), progress=False,
    )
    assert calls == [POLICY] * 3  # one cache per dialog

    rows = [json.loads(line) for line in (out / ANSWERS_FILE).read_text().splitlines()]
    assert [(r["dialog_id"], r["turn"]) for r in rows] == [
        ("101", 0), ("101", 1), ("101", 2), ("102", 0), ("103", 0), ("103", 1), ("103", 2)]
    skipped = [r for r in rows if r["skipped"]]
    assert [(r["dialog_id"], r["turn"]) for r in skipped] == [("103", 1), ("103", 2)]
    assert skipped[0]["skipped"] == "missing_image" and skipped[0]["answer"] is None
    answered = [r for r in rows if not r["skipped"]]
    for r in answered:
        assert isinstance(r["answer"], str) and r["n_new_tokens"] >= 1
        assert 0.0 <= r["rouge_l"] <= 1.0
        assert r["question"] and r["reference"]
    # the same cache is carried across turns: each turn starts where the previous one left it
    d101 = [r for r in rows if r["dialog_id"] == "101"]
    assert d101[0]["cached_before"] == 0
    for prev, cur in zip(d101, d101[1:]):
        assert cur["cached_before"] == prev["prompt_tokens"] + prev["n_new_tokens"] - 1
        assert cur["prompt_tokens"] > cur["cached_before"]
    # and it is the compressed one: it holds less than a full cache of what it has seen
    cfg = model.config.text_config
    full_bytes_per_token = cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2 * 4
    last = d101[-1]
    seen = last["prompt_tokens"] + last["n_new_tokens"] - 1
    assert 0 < last["kv_bytes"]["total"] < full_bytes_per_token * seen

    # random judge: unparsable replies are recorded and counted, not fatal
    judged = [json.loads(line) for line in (out / JUDGED_FILE).read_text().splitlines()]
    assert len(judged) == 7
    jq = [r for r in judged if not r["skipped"]]
    assert len(jq) == 5 == judge.calls
    for r in jq:
        assert r["judge"] == judge_dir.name
        assert isinstance(r["judge_text"], str)
        assert r["scores"] is None and r["parse_error"]
    assert summary["judge"]["name"] == judge_dir.name and summary["judge"]["path"] == str(judge_dir)
    assert summary["n_judged"] == 5 and summary["n_parse_failures"] == 5
    assert summary["scores"]["all"]["Overall Score"] == 0.0
    assert summary["scores"]["valid"]["Overall Score"] is None
    assert summary["n_questions"] == 7 and summary["n_answered"] == 5 and summary["n_skipped"] == 2
    assert summary["policy"] == POLICY and summary["budget"] == BUDGET
    assert summary["rouge_l"] == pytest.approx(sum(r["rouge_l"] for r in answered) / 5)
    assert summary["kv_bytes"]["max_per_turn_total"] > 0
    assert summary["data"]["problem_counts"] == {"missing_image": 1}
    assert json.loads((out / SUMMARY_FILE).read_text())["n_parse_failures"] == 5

    # rerun: everything finished is skipped (no cache built, no judge call)
    calls.clear()
    judge.calls = 0
    again = run_mmdu(model, processor, data, out, policy=POLICY, budget=BUDGET, judge=judge, max_new_tokens=6,
                     config={"model": "tiny-qwen2_5_vl"}, cache_factory=_counting_factory(calls), progress=False)
    assert calls == [] and judge.calls == 0
    assert again["counts"]["dialogs_done_before"] == 3 and again["counts"]["dialogs_run"] == 0
    assert again["n_judged"] == 5

    # simulated crash while dialog 102 was being written: its lines are gone, a half line remains
    for name in (ANSWERS_FILE, JUDGED_FILE):
        kept = [ln for ln in (out / name).read_text().splitlines() if json.loads(ln)["dialog_id"] != "102"]
        (out / name).write_text("\n".join(kept) + '\n{"dialog_id": "102", "turn": 0, "answ')
    calls.clear()
    judge.calls = 0
    resumed = run_mmdu(model, processor, data, out, policy=POLICY, budget=BUDGET, judge=judge, max_new_tokens=6,
                       config={"model": "tiny-qwen2_5_vl"}, cache_factory=_counting_factory(calls), progress=False)
    assert calls == [POLICY] and judge.calls == 1
    assert sorted(load_finished(out / ANSWERS_FILE)) == ["101", "102", "103"]
    assert len((out / ANSWERS_FILE).read_text().splitlines()) == 7  # no duplicates, no half line
    assert len((out / JUDGED_FILE).read_text().splitlines()) == 7
    assert resumed["n_judged"] == 5 and resumed["n_parse_failures"] == 5

    # another budget in the same folder is refused instead of mixing results
    with pytest.raises(ValueError, match="another run"):
        run_mmdu(model, processor, data, out, policy=POLICY, budget=64, judge=None, max_new_tokens=6,
                 config={"model": "tiny-qwen2_5_vl"}, progress=False)

    # judging the same folder with another judge is refused too
    def other_judge(prompt):
        raise AssertionError("must not be called")

    with pytest.raises(ValueError, match="judged by"):
        judge_answers(other_judge, out, progress=False)

    # a scripted judge on the same answers: numbers flow through to the summary
    out2 = tmp_path / "scripted"
    out2.mkdir()
    shutil.copy(out / ANSWERS_FILE, out2 / ANSWERS_FILE)
    replies = iter([
        "Good.\n{'Creativity': 6, 'Richness': 7, 'Visual Perception': 5, 'Logical Coherence': 8, "
        "'Answer Accuracy': 7, 'Image Relationship Understanding': 4, 'Overall Score': 6}",
        '```json\n{"creativity": 8, "richness": 6, "visual perception": 4, "logical coherence": 6, '
        '"answer accuracy": 5, "image relationship understanding": 6, "overall score": "9",}\n```',
        "{'Creativity': 3}",
        "no scores at all",
    ])

    def scripted(prompt):
        assert "[The Start of Reference Answer]" in prompt and "[The End of Assistant's Answer]" in prompt
        reply = next(replies, None)
        if reply is None:
            raise RuntimeError("judge crashed")
        return reply

    judge_answers(scripted, out2, progress=False)
    s2 = summarize(out2, data, judge_info={"name": "scripted"})
    assert s2["n_judged"] == 5
    assert s2["n_parse_failures"] == 2  # "no scores at all" and the judge exception
    assert s2["n_incomplete"] == 1 and s2["n_judge_errors"] == 1
    assert s2["scores"]["all"]["Overall Score"] == pytest.approx((6 + 9) / 5 * 10)
    assert s2["scores"]["valid"]["Overall Score"] == pytest.approx(75.0)
    assert s2["scores"]["all"]["Creativity"] == pytest.approx((6 + 8 + 3) / 5 * 10)
    assert s2["scores"]["valid"]["Creativity"] == pytest.approx((6 + 8 + 3) / 3 * 10)


class _Forced(LogitsProcessor):
    """Forces a fixed token sequence from position ``start``."""

    def __init__(self, seq, start):
        self.seq, self.start = seq, start

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.start
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.seq[min(step, len(self.seq) - 1)]] = 0.0
        return forced


def test_conversation_ids_equal_chat_template_and_cache_prefix(fixture_dir, vlm, monkeypatch):
    """With well-behaved answers, each turn's input is exactly the template's rendering of the
    whole conversation, and its cached prefix is exactly what the cache saw."""
    model, processor = vlm
    tok = processor.tokenizer
    data = load_mmdu(fixture_dir / "benchmark.json", fixture_dir)
    dialog = data.dialogs[0]
    answers = [f"Answer number {k}, fine." for k in range(3)]
    inputs_seen, real_generate = [], model.generate

    def forced_generate(**kw):
        k = len(inputs_seen)
        inputs_seen.append(kw["input_ids"][0].tolist())
        seq = tok.encode(answers[k], add_special_tokens=False) + [model.generation_config.eos_token_id]
        return real_generate(**kw, logits_processor=LogitsProcessorList([_Forced(seq, kw["input_ids"].shape[1])]))

    monkeypatch.setattr(model, "generate", forced_generate)
    cache = vlm_kv.make_cache(model, policy="full", budget=1.0)
    runner = DialogRunner(model, processor, cache, max_new_tokens=40)
    images = [Image.open(p).convert("RGB") for p in dialog.image_paths]
    per_turn = [images[:2], images[2:3], []]
    messages = []
    for k, turn in enumerate(dialog.turns):
        out = runner.run_turn(turn.question, per_turn[k])
        assert out.answer == answers[k] and out.stopped
        messages.append(runner.messages[-2])
        rendered = processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
        assert inputs_seen[k] == rendered["input_ids"][0].tolist()
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answers[k]}]})
        # the cache saw the prompt and the answer, not the stop token
        assert cache.get_seq_length() == len(inputs_seen[k]) + len(tok.encode(answers[k], add_special_tokens=False))
        if k:
            assert out.cached_before < len(inputs_seen[k])
            assert inputs_seen[k][: out.cached_before] == inputs_seen[k - 1] + tok.encode(answers[k - 1], add_special_tokens=False)

    # a cache that lies about what it has seen is caught before the next turn
    cache.crop(-3)
    with pytest.raises(CacheStateError):
        runner.run_turn("One more?", [])


def test_cached_multi_turn_equals_full_recompute(fixture_dir, vlm):
    """Prefilling new turns (with new images) on a warm full cache gives the same tokens as one
    uncached pass over the whole conversation with all images."""
    model, processor = vlm
    data = load_mmdu(fixture_dir / "benchmark.json", fixture_dir)
    dialog = data.dialogs[0]
    cache = vlm_kv.make_cache(model, policy="full", budget=1.0)
    runner = DialogRunner(model, processor, cache, max_new_tokens=5)
    images = [Image.open(p).convert("RGB") for p in dialog.image_paths]
    outs = [runner.run_turn(dialog.turns[0].question, images[:2]),
            runner.run_turn(dialog.turns[1].question, images[2:3])]
    assert not outs[-1].stopped
    ids = runner.state.ids[: outs[-1].prompt_tokens]
    img = processor.image_processor(images=images, return_tensors="pt")
    mm = torch.tensor([runner.state.mm_types[: len(ids)]])
    assert int(mm.sum()) == int((torch.tensor(ids) == processor.image_token_id).sum()) > 0
    with torch.inference_mode():
        ref = model.generate(
            input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            mm_token_type_ids=mm, pixel_values=img["pixel_values"], image_grid_thw=img["image_grid_thw"],
            max_new_tokens=5, do_sample=False, suppress_tokens=runner.suppress,
        )
    assert ref[0, len(ids):].tolist() == outs[-1].answer_ids


def test_data_problems_at_run_time_are_reported_not_fatal(vlm, tmp_path):
    model, processor = vlm
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "bad.png").write_bytes(b"\x89PNG broken")
    _draw(tmp_path / "pics" / "ok.png", 1)
    bench = {
        "x": {"id": "x", "image": ["pics/ok.png", "pics/bad.png"], "conversations": [
            _u("<ImageHere>q1"), _a("r1"), _u("<ImageHere>q2"), _a("r2"), _u("q3"), _a("r3")]},
        "y": {"id": "y", "image": ["pics/absent.png"], "conversations": [_u("<ImageHere>q"), _a("r")]},
        "z": {"id": "z", "image": []},
    }
    (tmp_path / "b.json").write_text(json.dumps(bench))
    data = load_mmdu(tmp_path / "b.json", tmp_path)
    assert data.problem_counts() == {"missing_image": 1, "malformed_dialog": 1}  # bad.png exists on disk
    calls = []
    counts = generate_answers(model, processor, data, tmp_path / "out", policy="full", budget=1.0,
                              max_new_tokens=3, cache_factory=_counting_factory(calls), progress=False)
    assert counts["dialogs_run"] == 2 and calls == ["full"]  # no cache for a dialog with nothing to run
    rows = {d: rs for d, rs in load_finished(tmp_path / "out" / ANSWERS_FILE).items()}
    assert sorted(rows) == ["x", "y"]
    assert [r["skipped"] is None for r in rows["x"]] == [True, False, False]
    assert rows["x"][1]["skipped"].startswith("unreadable_image")  # decoding failed while running
    assert rows["x"][2]["skipped"] == "after_unrunnable_turn:1"
    assert rows["y"][0]["skipped"] == "missing_image"
    s = summarize(tmp_path / "out", data)
    assert s["n_questions"] == 4 and s["n_answered"] == 1 and s["n_skipped"] == 3
    assert len(s["skipped_questions"]) == 3 and s["scores"] is None and s["judge"] is None
    assert {p["kind"] for p in s["data_problems"]} == {"missing_image", "malformed_dialog"}


def test_cli_subcommand(fixture_dir, vlm, judge_dir, tmp_path, monkeypatch):
    model, processor = vlm
    loaded = []

    def fake_load(path, device=None):
        loaded.append(path)
        return model, processor

    monkeypatch.setattr(mmdu_cli, "load_vlm", fake_load)
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd")
    mmdu_cli.register(sub)
    out = tmp_path / "cli"
    args = parser.parse_args([
        "mmdu", "--model", "some/vlm", "--data", str(fixture_dir / "benchmark.json"), "--images", str(fixture_dir),
        "--judge", str(judge_dir), "--policy", "full", "--budget", "1.0", "--limit", "2", "--out", str(out),
        "--max-new-tokens", "3", "--judge-max-new-tokens", "4",
    ])
    assert args.budget == 1.0  # "1.0" is the whole cache; a bare "1" is refused as ambiguous (Budget.parse)
    assert args.func(args) == 0
    assert loaded == ["some/vlm"]
    s = json.loads((out / SUMMARY_FILE).read_text())
    assert s["n_dialogs"] == 2 and s["n_questions"] == 4 and s["n_judged"] == 4
    assert s["judge"]["path"] == str(judge_dir) and s["n_parse_failures"] == 4
    assert s["policy"] == "full" and s["kv_bytes"] is None

    base = ["mmdu", "--model", "m", "--data", "d", "--images", "i", "--policy", "p"]
    assert parser.parse_args(base + ["--budget", "0.25"]).budget == 0.25
    assert parser.parse_args(base + ["--budget", "256"]).budget == 256
    no_judge = parser.parse_args(base + ["--budget", "0.5"])
    assert no_judge.func(no_judge) == 2  # neither --judge nor --no-judge
