"""train-vlm's loop on a tiny language model with SmolLM2's tokenizer: losses, resume, outputs."""

import json

import pytest
import torch

from vlm_kv.models import smollava as S
from vlm_kv.eval import visual_qa as Q
from vlm_kv.train import vlm_train as V
from vlm_kv.eval.visual_tasks import make_item


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


def _tiny(tokenizer, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                                      max_position_embeddings=4096, pad_token_id=2))
    return S.build_smollava(lm, tokenizer)


def _cfg(tmp_path, **kw):
    base = dict(out=str(tmp_path), patch_steps=2, patch_batch=2, qa_steps=2, qa_batch=2, multi_every=2,
                multi_images="2,2", multi_questions=2, negatives=16, warmup=1, lm_dtype="float32", save_every=1,
                eval_every=0, eval_items=1, eval_multi_items=0, progress=False)
    base.update(kw)
    return V.VLMTrainConfig(**base)


def test_labels_cover_only_the_answers(tokenizer):
    item = make_item("multi_turn", 0, 0, n_images=2, n_questions=2)
    ids, labels = Q.encode_pieces(tokenizer, Q.conversation_pieces(item, ["red", "left"]))
    assert ids.count(S.IMAGE_TOKEN_ID) == 2 * S.IMAGE_TOKENS
    answered = tokenizer.decode([t for t in labels if t != Q.IGNORE])
    assert answered == "red<|im_end|>left<|im_end|>"


def test_patch_loss_falls_on_a_repeated_batch(tokenizer):
    model, _ = _tiny(tokenizer)
    targets = V.PatchTargets(tokenizer, model.get_input_embeddings().weight)
    scenes = V._scenes(0, 2)
    params = V._trainable(model)
    opt = torch.optim.AdamW(params, lr=2e-3)
    pixels = S.pixel_values([s.image for s in scenes])
    losses = []
    for step in range(12):
        loss, stats = V.patch_loss(V.visual_tokens(model, pixels), targets.of_scenes(scenes), targets,
                                   torch.Generator().manual_seed(step), 16)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    assert 0.0 <= stats["patch_acc"] <= 1.0


def test_resumed_run_equals_a_straight_run(tokenizer, tmp_path):
    model_a, proc_a = _tiny(tokenizer)
    V.train_vlm(_cfg(tmp_path / "a"), model_a, proc_a)
    model_b, proc_b = _tiny(tokenizer)
    V.train_vlm(_cfg(tmp_path / "b", stop_at=3), model_b, proc_b)
    assert not (tmp_path / "b" / "final").exists()  # stopped early: no final weights yet
    model_c, proc_c = _tiny(tokenizer)  # a fresh process: weights come from the checkpoint
    V.train_vlm(_cfg(tmp_path / "b"), model_c, proc_c)
    for (name, a), c in zip(S.trained_state(model_a).items(), S.trained_state(model_c).values()):
        torch.testing.assert_close(a, c, msg=name)
    lines = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    steps = [x["step"] for x in lines if "eval" not in x]
    assert steps == [1, 2, 3, 4]
    assert [x["stage"] for x in lines if "eval" not in x] == ["patch", "patch", "qa", "qa"]
    assert {x.get("kind") for x in lines if x.get("stage") == "qa"} == {"single", "multi"}
    assert any("eval" in x for x in lines)
    card = json.loads((tmp_path / "b" / "final" / "card.json").read_text())
    assert card["train_data_seed"] == 0 and "last_eval" in card


def test_answer_runs_turns_on_one_cache(tokenizer):
    from transformers import DynamicCache

    model, _ = _tiny(tokenizer)
    item = make_item("multi_turn", 1, 0, n_images=2, n_questions=2)
    cache = DynamicCache()
    answers = Q.answer(model, tokenizer, item, max_new_tokens=3, cache=cache)
    assert len(answers) == 2
    prompt = len(Q.encode_pieces(tokenizer, Q.conversation_pieces(item, [], 1))[0])
    assert cache.get_seq_length() > prompt  # the second turn was prefilled on top of the first


@pytest.mark.parametrize("bad, match", [(dict(multi_images="5,2"), "LO,HI"), (dict(multi_images="x"), "LO,HI"),
                                        (dict(qa_batch=0), "qa_batch"), (dict(lm_dtype="int8"), "lm_dtype"),
                                        (dict(lora_rank=-1), "lora_rank"), (dict(lora_rank=2, lora_targets=","), "target"),
                                        (dict(lora_rank=2, lora_alpha=0.0), "lora_alpha"),
                                        (dict(lora_rank=2, lora_grow=True), "lora_grow"),
                                        (dict(multi_questions=3, multi_images="2,4"), "multi_questions"),
                                        (dict(image_labels="closed"), "image_labels"),
                                        (dict(multi_kinds="colour,hue"), "multi_kinds"),
                                        (dict(attention_weight=-1.0), "attention_weight"),
                                        (dict(attention_weight=1.0, attention_layers="a,b"), "attention_layers"),
                                        (dict(attention_weight=1.0, attention_layers=","), "attention_layers")])
def test_config_is_checked(bad, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        _cfg(tmp_path, **bad).validate()


def test_multi_kinds_weight_the_multi_image_questions(tmp_path):
    cfg = _cfg(tmp_path, multi_every=1, multi_images="3,3", multi_questions=3, multi_kinds="colour")
    cfg.validate()
    kinds = {q.kind for step in range(4) for q in V._qa_items(cfg, step)[0][0].questions}
    assert kinds == {"colour"}
    default = _cfg(tmp_path, multi_every=1, multi_images="3,3", multi_questions=3)
    assert default.multi_kind_list == V.KINDS
    drawn = {q.kind for step in range(12) for q in V._qa_items(default, step)[0][0].questions}
    assert len(drawn) > 1  # without the option every kind can be asked


def test_stage1_weights_continue_exactly_where_the_run_would(tokenizer, tmp_path):
    model_a, proc_a = _tiny(tokenizer)
    V.train_vlm(_cfg(tmp_path / "a"), model_a, proc_a)
    assert (tmp_path / "a" / V.STAGE1 / S.WEIGHTS_FILE).is_file()
    model_b, proc_b = _tiny(tokenizer)
    with torch.no_grad():  # another starting tower: every trained weight must come from stage1/
        for p in V._trainable(model_b):
            p.add_(torch.randn_like(p))
    V.train_vlm(_cfg(tmp_path / "b", stage1_weights=str(tmp_path / "a" / V.STAGE1)), model_b, proc_b)
    for (name, a), b in zip(S.trained_state(model_a).items(), S.trained_state(model_b).values()):
        torch.testing.assert_close(a, b, msg=name)
    steps = [json.loads(x).get("stage") for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert "patch" not in steps


def test_export_ships_the_checkpoint_and_a_later_run_continues_from_it(tokenizer, tmp_path):
    model_a, proc_a = _tiny(tokenizer)
    V.train_vlm(_cfg(tmp_path / "a", qa_steps=3, stop_at=3), model_a, proc_a)
    V.export_checkpoint(tmp_path / "a", tmp_path / "shipped")
    card = json.loads((tmp_path / "shipped" / "card.json").read_text())
    assert card["done"] == 3 and card["stage"] == "qa" and card["train_data_seed"] == 0
    loaded, _ = _tiny(tokenizer, seed=1)
    S.load_trained_parts(loaded, tmp_path / "shipped")
    for (name, a), b in zip(S.trained_state(model_a).items(), S.trained_state(loaded).values()):
        torch.testing.assert_close(a, b, msg=name)
    # another session: the exported parts and their step; only the QA steps after it run
    model_b, proc_b = _tiny(tokenizer, seed=2)
    V.train_vlm(_cfg(tmp_path / "b", qa_steps=3, stage1_weights=str(tmp_path / "shipped")), model_b, proc_b)
    steps = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
             if "eval" not in json.loads(x)]
    assert steps == [4, 5]
    with pytest.raises(FileNotFoundError, match="no checkpoint to export"):
        V.export_checkpoint(tmp_path / "nothing", tmp_path / "x")


def test_a_fresh_optimizer_mid_schedule_warms_up_again_and_a_resume_keeps_that(tokenizer, tmp_path):
    model_a, proc_a = _tiny(tokenizer)
    V.train_vlm(_cfg(tmp_path / "a", qa_steps=8, stop_at=4), model_a, proc_a)
    V.export_checkpoint(tmp_path / "a", tmp_path / "shipped")  # done = 4: patch 2 + QA 2
    cfg = dict(qa_steps=8, warmup=3, stage1_weights=str(tmp_path / "shipped"))
    model_b, proc_b = _tiny(tokenizer, seed=2)
    V.train_vlm(_cfg(tmp_path / "b", stop_at=6, **cfg), model_b, proc_b)
    model_c, proc_c = _tiny(tokenizer, seed=3)  # another session resumes from b's checkpoint
    V.train_vlm(_cfg(tmp_path / "b", **cfg), model_c, proc_c)
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["lr"] for r in rows if "eval" not in r}
    assert sorted(lr) == list(range(5, 11))
    schedule = _cfg(tmp_path / "b", **cfg)
    for step, got in lr.items():
        ramp = min(1.0, (step - 4) / 3)  # steps 5, 6 at 1/3, 2/3 of the schedule's rate, then all of it
        assert got == pytest.approx(V._lr(schedule, "qa", step - 1 - 2) * ramp)


def _adapters(model):
    return {n: m for n, m in model.model.language_model.named_modules() if getattr(m, "_lora_attached", False)}


def test_lora_run_resumes_exports_and_ships_merged(tokenizer, tmp_path):
    lora = dict(lora_rank=2, lora_targets="q_proj,v_proj", eval_multi_items=1)
    model_a, proc_a = _tiny(tokenizer)
    V.train_vlm(_cfg(tmp_path / "a", **lora), model_a, proc_a)
    assert len(_adapters(model_a)) == 4  # two layers x q_proj, v_proj
    model_b, proc_b = _tiny(tokenizer)
    V.train_vlm(_cfg(tmp_path / "b", stop_at=3, **lora), model_b, proc_b)
    model_c, proc_c = _tiny(tokenizer)
    V.train_vlm(_cfg(tmp_path / "b", **lora), model_c, proc_c)  # resumed: tower and adapters
    ckpt_a = torch.load(tmp_path / "a" / V.CHECKPOINT, weights_only=False)
    ckpt_c = torch.load(tmp_path / "b" / V.CHECKPOINT, weights_only=False)
    assert ckpt_a["lora"] and any(v.abs().sum() > 0 for k, v in ckpt_a["lora"].items() if k.endswith(".B"))
    for k, v in ckpt_a["lora"].items():
        torch.testing.assert_close(v, ckpt_c["lora"][k], msg=k)
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert {r["eval"]["task"] for r in rows if "eval" in r} == {"single", "multi_image"}
    assert (tmp_path / "a" / "final" / S.LORA_FILE).is_file()
    # the shipped folder: a plain model with the adapters merged answers as the hooked one did
    ids = torch.tensor([[1, 504, 3458, 314, 253]])
    shipped, _ = _tiny(tokenizer)
    S.load_trained_parts(shipped, tmp_path / "a" / "final")
    with torch.no_grad():
        torch.testing.assert_close(shipped(input_ids=ids).logits, model_a(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    V.export_checkpoint(tmp_path / "a", tmp_path / "exp")
    assert S.read_lora(tmp_path / "exp")[1] == V.VLMTrainConfig(**{**_cfg(tmp_path).__dict__, **lora}).lora_spec


def test_lora_and_plain_runs_do_not_mix(tokenizer, tmp_path):
    model, proc = _tiny(tokenizer)
    V.train_vlm(_cfg(tmp_path / "plain", stop_at=3), model, proc)
    with pytest.raises(ValueError, match="without LoRA"):
        V.train_vlm(_cfg(tmp_path / "plain", lora_rank=2), *_tiny(tokenizer))
    model, proc = _tiny(tokenizer)
    V.train_vlm(_cfg(tmp_path / "lora", stop_at=3, lora_rank=2), model, proc)
    V.export_checkpoint(tmp_path / "lora", tmp_path / "exp")
    with pytest.raises(ValueError, match="holds LoRA"):
        V.train_vlm(_cfg(tmp_path / "next", stage1_weights=str(tmp_path / "exp")), *_tiny(tokenizer))
    with pytest.raises(ValueError, match="differs"):
        V.train_vlm(_cfg(tmp_path / "next2", stage1_weights=str(tmp_path / "exp"), lora_rank=4), *_tiny(tokenizer))
    # a plain export over a folder that had adapters drops them (they belong to another tower)
    V.export_checkpoint(tmp_path / "plain", tmp_path / "exp")
    assert S.read_lora(tmp_path / "exp") is None


def test_larger_adapters_grow_from_an_export_and_start_as_the_same_model(tokenizer, tmp_path):
    model, proc = _tiny(tokenizer)
    V.train_vlm(_cfg(tmp_path / "lora", stop_at=3, lora_rank=2, lora_targets="q_proj,v_proj"), model, proc)
    V.export_checkpoint(tmp_path / "lora", tmp_path / "exp")
    grown = dict(stage1_weights=str(tmp_path / "exp"), lora_rank=4, lora_targets="q_proj,v_proj,o_proj,up_proj",
                 lora_grow=True)
    model_b, proc_b = _tiny(tokenizer)  # the same frozen LM; the tower and adapters come from the export
    V.train_vlm(_cfg(tmp_path / "grown", stop_at=3, **grown), model_b, proc_b)  # no step yet: loaded only
    shipped, _ = _tiny(tokenizer)
    S.load_trained_parts(shipped, tmp_path / "exp")
    ids = torch.tensor([[1, 504, 3458, 314, 253]])
    with torch.no_grad():
        torch.testing.assert_close(model_b(input_ids=ids).logits, shipped(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    assert len(_adapters(model_b)) == 8  # two layers x four targets
    with pytest.raises(ValueError, match="differs"):  # without --lora-grow a larger spec is refused
        V.train_vlm(_cfg(tmp_path / "n", **{**grown, "lora_grow": False}), *_tiny(tokenizer))


def test_attention_loss_is_logged_on_multi_image_steps_and_moves_the_adapters(tokenizer, tmp_path):
    extra = dict(lora_rank=2, lora_targets="q_proj,k_proj", attention_layers="0,1")
    runs = {}
    for w in (0.0, 5.0):
        model, proc = _tiny(tokenizer)
        V.train_vlm(_cfg(tmp_path / str(w), attention_weight=w, **extra), model, proc)
        runs[w] = torch.load(tmp_path / str(w) / V.CHECKPOINT, weights_only=False)["lora"]
        rows = [json.loads(x) for x in (tmp_path / str(w) / "metrics.jsonl").read_text().splitlines()]
        multi = [r for r in rows if r.get("kind") == "multi"]
        single = [r for r in rows if r.get("kind") == "single"]
        assert multi and single and not any("attention_loss" in r for r in single)
        if w:
            assert all(r["attention_loss"] > 0 and 0 < r["asked_share"] < 1 for r in multi)
        else:
            assert not any("attention_loss" in r for r in multi)
    # the same data and seeds: only the attention term differs, and it reaches the q/k adapters
    assert any(not torch.equal(runs[0.0][k], runs[5.0][k]) for k in runs[0.0])
