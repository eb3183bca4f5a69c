import json
import math

import pytest
import torch
from PIL import Image, ImageDraw

from vlm_kv import make_cache
from vlm_kv.gates.io import load_gates
from vlm_kv.models.adapters import get_adapter
from vlm_kv.testing import tiny_model, tiny_processor
from vlm_kv.train.loop import TrainConfig, latest_checkpoint, train_gates


def _write_conversations(tmp_path, n=3):
    records = []
    for i in range(n):
        img = Image.new("RGB", (24 + 8 * i, 24), (20 * i, 120, 200 - 30 * i))
        ImageDraw.Draw(img).rectangle([4, 4, 12 + i, 14], fill=(255, 255 - 40 * i, 0))
        img.save(tmp_path / f"img{i}.png")
        if i % 2 == 0:  # LLaVA style
            records.append({"image": f"img{i}.png", "conversations": [
                {"from": "human", "value": f"<image>\nWhat colour is box {i}?"},
                {"from": "gpt", "value": f"The box {i} is yellow and sits on blue ground."}]})
        else:  # messages style
            records.append({"messages": [
                {"role": "user", "content": [{"type": "image", "image": f"img{i}.png"},
                                             {"type": "text", "text": "Describe the picture."}]},
                {"role": "assistant", "content": [{"type": "text", "text": "A small box of colour."}]}]})
    path = tmp_path / "conv.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def _cfg(model, proc, data, out, **kw):
    base = dict(model=model, processor=proc, data=[data], out=str(out), budget_tokens=8, global_budget=True,
                max_length=64, steps=4, lr=3e-2, warmup=0, width=16, init_bias=4.0, progress=False,
                save_every=1)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_train_save_load_generate_with_images(tmp_path, family):
    torch.manual_seed(0)
    model, proc = tiny_model(family), tiny_processor(family)
    data = _write_conversations(tmp_path)
    out = tmp_path / "gates"
    # a fixed batch: one conversation, repeated every step
    single = tmp_path / "one.jsonl"
    single.write_text(open(data).readline())
    res = train_gates(_cfg(model, proc, str(single), out, steps=6))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == list(range(1, 7))
    losses = [ln["loss"] for ln in lines]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    assert lines[-1]["live"] < lines[0]["live"]
    assert res["step"] == 6 and all(not p.requires_grad for p in model.parameters())

    gates = load_gates(str(out), fingerprint=get_adapter(model).fingerprint())
    assert gates.config.training["budget_tokens"] == 8 and gates.config.training["global"] is True
    assert gates.config.training["data"] == [str(single)] and gates.config.training["max_length"] == 64
    for a, b in zip(gates.state_dict().values(), res["gates"].state_dict().values()):
        torch.testing.assert_close(a, b.cpu())

    img = Image.open(tmp_path / "img0.png")
    messages = [{"role": "user", "content": [{"type": "image", "image": img},
                                             {"type": "text", "text": "What is in the image?"}]}]
    inputs = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=True, return_tensors="pt")
    cache = make_cache(model, "dbtrimkv", budget=0.5, gates=str(out))
    gen = model.generate(**inputs, past_key_values=cache, max_new_tokens=5, do_sample=False)
    assert gen.shape[1] == inputs["input_ids"].shape[1] + 5
    # eviction really happened: the cache holds fewer entries than a full cache would
    full_entries = cache.get_seq_length() * 2 * 2  # seen tokens x 2 layers x 2 KV heads (batch 1)
    assert cache.eviction_steps >= 1 and 0 < cache.num_entries() < full_entries


def test_resume_reproduces_next_step(tmp_path):
    model, proc = tiny_model("qwen2_5_vl"), tiny_processor("qwen2_5_vl")
    data = _write_conversations(tmp_path)
    straight = train_gates(_cfg(model, proc, data, tmp_path / "a", steps=3, batch_size=2, grad_accum=2))
    train_gates(_cfg(model, proc, data, tmp_path / "b", steps=3, batch_size=2, grad_accum=2, stop_at=2))
    assert latest_checkpoint(str(tmp_path / "b")).endswith("step-0000002.pt")
    resumed = train_gates(_cfg(model, proc, data, tmp_path / "b", steps=3, batch_size=2, grad_accum=2, resume=True))
    for (k, a), b in zip(straight["gates"].state_dict().items(), resumed["gates"].state_dict().values()):
        assert torch.equal(a, b), k
    sa = torch.load(latest_checkpoint(str(tmp_path / "a")), weights_only=False)
    sb = torch.load(latest_checkpoint(str(tmp_path / "b")), weights_only=False)
    assert sa["step"] == sb["step"] == 3 and sa["data"] == sb["data"]
    assert sa["scheduler"] == sb["scheduler"]
    for pid, st in sa["optimizer"]["state"].items():
        for key, val in st.items():
            assert torch.equal(val, sb["optimizer"]["state"][pid][key]), (pid, key)
    la = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    lb = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    strip = lambda s: {k: v for k, v in json.loads(s).items() if k != "sec"}  # noqa: E731
    assert [strip(x) for x in la] == [strip(x) for x in lb]


def test_cli_text_file_tiny_llama(tmp_path):
    from vlm_kv.cli.main import build_parser

    folder = tmp_path / "llama"
    tiny_model("llama").save_pretrained(folder)
    tiny_processor("llama").save_pretrained(folder)
    text = tmp_path / "book.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good "
                    "fortune, must be in want of a wife. " * 6)
    out = tmp_path / "gates"
    args = build_parser().parse_args([
        "train-gates", "--model", str(folder), "--data", str(text), "--budget-tokens", "16",
        "--max-length", "96", "--steps", "2", "--out", str(out), "--kind", "trimkv", "--width", "8",
        "--no-progress", "--save-every", "1"])
    assert args.func(args) == 0
    gates = load_gates(str(out))
    assert gates.config.kind == "trimkv" and gates.config.training["global"] is False
    assert gates.config.training["steps"] == 2 and gates.config.num_layers == 2
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


def test_missing_training_data_fails_before_the_model_loads(tmp_path, monkeypatch, capsys):
    import vlm_kv.train.loop as loop
    from vlm_kv.cli.main import main

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the data files were checked")

    monkeypatch.setattr(loop, "load_model_and_processor", refuse)
    argv = ["train-gates", "--data", str(tmp_path / "nope.txt"), "--budget-tokens", "8", "--steps", "1",
            "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    assert f"training data file not found: {tmp_path / 'nope.txt'}" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("")
    argv[2] = str(tmp_path / "empty.txt")
    assert main(argv) == 2
    assert "is empty" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_truncation_drops_cut_images(tmp_path, family):
    from vlm_kv.models.adapters import get_adapter
    from vlm_kv.train.data import TrainingData

    Image.new("RGB", (32, 32), (1, 2, 3)).save(tmp_path / "a.png")
    (tmp_path / "c.jsonl").write_text(json.dumps({"image": ["a.png", "a.png"], "conversations": [
        {"from": "human", "value": "Hi <image> and <image> ok"}, {"from": "gpt", "value": "yes"}]}) + "\n")
    model, proc = tiny_model(family), tiny_processor(family)
    image_id = get_adapter(model).image_token_id
    seen = set()
    for t in (5, 12, 30, 34, 50, 400):
        sample = TrainingData([str(tmp_path / "c.jsonl")], proc, t, image_token_id=image_id).sample(0)
        assert sample["input_ids"].shape[1] <= t
        seen.add(int((sample["input_ids"] == image_id).sum()) // 16)  # 16 tokens per tiny image
        sample.pop("labels")
        with torch.no_grad():
            assert torch.isfinite(model(**sample).logits).all()
    assert seen == {0, 1, 2}


def _text_setup(tmp_path):
    model, proc = tiny_model("llama"), tiny_processor("llama")
    text = tmp_path / "book.txt"
    text.write_text(" ".join(f"word{i % 37} and the {i % 11} things" for i in range(400)))
    return model, proc, str(text)


def test_sampled_budgets_depend_on_seed_and_step_only():
    from vlm_kv.train.loop import sampled_budget

    cfg = TrainConfig(data=["x"], out="y", budget_tokens=None, budget_range=(0.05, 0.3), seed=3)
    draws = [sampled_budget(cfg, s) for s in range(200)]
    assert draws == [sampled_budget(cfg, s) for s in range(200)]
    assert all(0.05 <= f <= 0.3 for f in draws) and len(set(draws)) == 200
    # log-uniform: about half the draws below the geometric mean of the range
    below = sum(f < math.sqrt(0.05 * 0.3) for f in draws)
    assert 70 < below < 130
    other = TrainConfig(data=["x"], out="y", budget_tokens=None, budget_range=(0.05, 0.3), seed=4)
    assert [sampled_budget(other, s) for s in range(5)] != draws[:5]
    fixed = TrainConfig(data=["x"], out="y", budget_tokens=None, budget_range=(0.1, 0.1))
    assert sampled_budget(fixed, 7) == 0.1
    assert sampled_budget(TrainConfig(data=["x"], out="y", budget_tokens=8), 0) is None


def test_budget_options_fail_closed(tmp_path):
    model, proc, text = _text_setup(tmp_path)
    for kw, msg in ((dict(budget_tokens=None), "budget_tokens >= 1 or a budget_range"),
                    (dict(budget_tokens=8, budget_range=(0.1, 0.2)), "either budget_tokens or budget_range"),
                    (dict(budget_tokens=None, budget_range=(0.3, 0.1)), "0 < lo <= hi <= 1")):
        with pytest.raises(ValueError, match=msg):
            train_gates(_cfg(model, proc, text, tmp_path / "x", **kw))


def test_multi_budget_resume_reproduces_draws_and_config_records_everything(tmp_path):
    model, proc, text = _text_setup(tmp_path)
    kw = dict(budget_tokens=None, budget_range=(0.05, 0.5), steps=4, max_length=48, warmup=1, min_lr=1e-3,
              weight_decay=0.01, seed=5)
    straight = train_gates(_cfg(model, proc, text, tmp_path / "a", **kw))
    train_gates(_cfg(model, proc, text, tmp_path / "b", stop_at=2, **kw))
    resumed = train_gates(_cfg(model, proc, text, tmp_path / "b", resume=True, **kw))
    for a, b in zip(straight["gates"].state_dict().values(), resumed["gates"].state_dict().values()):
        assert torch.equal(a, b)
    la = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    budgets = [x["budget"] for x in la]
    assert budgets == [x["budget"] for x in lb] and len(set(budgets)) == 4
    assert all(0.05 <= f <= 0.5 for f in budgets)
    info = load_gates(str(tmp_path / "a")).config.training
    want = {"budget_range": [0.05, 0.5], "budget_tokens": None, "warmup": 1, "min_lr": 1e-3, "lr": 3e-2,
            "weight_decay": 0.01, "steps": 4, "max_length": 48, "width": 16, "init_bias": 4.0, "seed": 5,
            "data": [text], "kind": "dbtrimkv", "coupled": True, "global": True, "init_gates": None,
            "betas": [0.9, 0.95], "grad_clip": 1.0, "lambda_cap": 1.0, "steps_done": 4}
    assert {k: info.get(k) for k in want} == want


def test_init_gates_starts_from_saved_gates(tmp_path):
    model, proc, text = _text_setup(tmp_path)
    first = train_gates(_cfg(model, proc, text, tmp_path / "a", steps=2, max_length=48))
    # zero learning rate: the fine-tuned gates are exactly the ones they started from
    again = train_gates(_cfg(model, proc, text, tmp_path / "b", steps=1, max_length=48, lr=1e-12, min_lr=1e-12,
                             init_gates=str(tmp_path / "a"), weight_decay=0.0))
    for a, b in zip(first["gates"].state_dict().values(), again["gates"].state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
    assert load_gates(str(tmp_path / "b")).config.training["init_gates"] == str(tmp_path / "a")
    with pytest.raises(ValueError, match="width 16"):
        train_gates(_cfg(model, proc, text, tmp_path / "c", steps=1, max_length=48, width=8,
                         init_gates=str(tmp_path / "a")))


def test_export_checkpoint_of_a_stopped_run(tmp_path):
    from vlm_kv.train.loop import export_checkpoint

    model, proc, text = _text_setup(tmp_path)
    res = train_gates(_cfg(model, proc, text, tmp_path / "a", steps=4, stop_at=2, max_length=48))
    assert not (tmp_path / "a" / "gate_config.json").exists()  # not finished: no final gates
    gates = export_checkpoint(latest_checkpoint(str(tmp_path / "a")), str(tmp_path / "x"), dtype=torch.float16)
    loaded = load_gates(str(tmp_path / "x"), fingerprint=get_adapter(model).fingerprint())
    assert loaded.config.training["steps_done"] == 2 and loaded.config.training["steps"] == 4
    for a, b in zip(res["gates"].state_dict().values(), loaded.state_dict().values()):
        torch.testing.assert_close(a.half().float(), b)
    assert gates.config.width == 16


def test_loop_capacity_target_follows_each_steps_sampled_budget(tmp_path, monkeypatch):
    """The loop hands capacity_loss M = (the step's sampled fraction) x (the sequence's valid length)."""
    import vlm_kv.train.loop as loop

    seen = []
    real = loop.capacity_loss

    def recording(log_betas, budget, global_budget, valid=None, **kw):
        seen.append((torch.as_tensor(budget).clone(), valid.sum(-1).clone(), global_budget))
        return real(log_betas, budget, global_budget, valid=valid, **kw)

    monkeypatch.setattr(loop, "capacity_loss", recording)
    model, proc, text = _text_setup(tmp_path)
    cfg = _cfg(model, proc, text, tmp_path / "a", budget_tokens=None, budget_range=(0.05, 0.5), steps=3,
               max_length=48, seed=2)
    train_gates(cfg)
    assert len(seen) == 3
    lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    for step, ((m, n_valid, global_budget), line) in enumerate(zip(seen, lines)):
        fraction = loop.sampled_budget(cfg, step)
        assert line["budget"] == fraction and global_budget is True
        torch.testing.assert_close(m, fraction * n_valid.float())
    assert len({round(float(m[0]), 6) for m, _, _ in seen}) == 3  # a new target every step


def test_answer_weight_weighs_the_fact_answers_and_needs_facts(tmp_path):
    model, proc, text = _text_setup(tmp_path)
    # text only (a .jsonl of text records here): no facts, no conversations, so no answers to weigh
    with pytest.raises(ValueError, match="only with a facts share|hold no conversations"):
        train_gates(_cfg(model, proc, text, tmp_path / "x", answer_weight=1.0))
    runs = {}
    for weight in (0.0, 5.0):
        torch.manual_seed(0)
        out = tmp_path / f"w{weight}"
        train_gates(_cfg(model, proc, text, out, max_length=640, steps=2, facts_share=1.0, facts_per_sample=2,
                         answer_weight=weight))
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[weight] = (rows, load_gates(str(out)))
    rows0, gates0 = runs[0.0]
    rows5, gates5 = runs[5.0]
    assert all(r["answer_kl"] > 0 for r in rows0 + rows5)  # the answers are measured either way
    assert rows0[0]["kl"] == pytest.approx(rows5[0]["kl"])  # same first batch, same start
    assert rows5[0]["loss"] > rows0[0]["loss"]  # the answer term is added
    assert gates5.config.training["answer_weight"] == 5.0 and gates5.config.training["facts_share"] == 1.0
    differs = [not torch.equal(a, b) for a, b in zip(gates0.state_dict().values(), gates5.state_dict().values())]
    assert any(differs)  # and it moves the gates
