"""The reconstruction teacher of gate training (train/teacher.py); tiny random models: code paths only."""

import json

import pytest
import torch
from vlm_kv.gates.io import load_gates
from vlm_kv.train.loop import TrainConfig, train_gates
from vlm_kv.train.teacher import kept_count, ranking_loss, reconstruction_kept

from vlm_kv.reconstruction import plan_read_back, reconstruction_scores
from vlm_kv.testing import random_tokens, tiny_model, tiny_processor


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama"), tiny_processor("llama")


def test_kept_set_is_kvzips_global_top_entries_with_its_sinks(llama):
    model, tok = llama
    ids = random_tokens(40, seed=3)
    kept = reconstruction_kept(model, tok, ids, torch.ones_like(ids), fraction=0.2, sinks=2)
    n_layers = model.config.num_hidden_layers
    heads = model.config.num_key_value_heads
    assert kept.shape == (n_layers, 1, heads, 40) and kept.dtype == torch.bool
    assert int(kept.sum()) == kept_count(0.2, n_layers * heads * 40)
    assert bool(kept[..., :2].all())  # the sinks, always kept
    scores = torch.stack(reconstruction_scores(model, ids, plan_read_back(tok, ids), sinks=2))
    scores[..., :2] = float("inf")
    # every kept entry scores at least as high as every dropped one, over all layers and heads
    assert scores[kept].min() >= scores[~kept].max()


def test_kept_set_per_layer_takes_the_same_share_of_every_layer(llama):
    model, tok = llama
    ids = random_tokens(40, seed=3)
    kept = reconstruction_kept(model, tok, ids, torch.ones_like(ids), fraction=0.2, sinks=2, per_layer=True)
    heads = model.config.num_key_value_heads
    per_layer = kept.sum(dim=(1, 2, 3))
    assert per_layer.tolist() == [kept_count(0.2, heads * 40)] * model.config.num_hidden_layers
    scores = torch.stack(reconstruction_scores(model, ids, plan_read_back(tok, ids), sinks=2))
    scores[..., :2] = float("inf")
    for layer in range(kept.shape[0]):  # ranked within the layer
        assert scores[layer][kept[layer]].min() >= scores[layer][~kept[layer]].max()


def test_kept_set_refuses_padded_rows_and_bad_fractions(llama):
    model, tok = llama
    ids = random_tokens(12, seed=1)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="unpadded rows"):
        reconstruction_kept(model, tok, ids, mask, fraction=0.5)
    with pytest.raises(ValueError, match=r"teacher budget fraction must be in \(0, 1\]"):
        reconstruction_kept(model, tok, ids, torch.ones_like(ids), fraction=0.0)


def _log_betas(n_layers=2, heads=2, t=10, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    out = [(-torch.rand(1, heads, t, generator=g) * 0.5).requires_grad_(requires_grad) for _ in range(n_layers)]
    return out


def test_ranking_loss_agrees_fully_when_the_gates_rank_as_the_teacher():
    log_betas = _log_betas()
    t = 10
    age = torch.arange(t - 1, -1, -1).float()
    score = torch.stack([(age * lb).detach() for lb in log_betas])  # [L, 1, H, T]
    k = 7
    flat = score.permute(1, 0, 2, 3).reshape(1, -1)
    top = torch.zeros_like(flat, dtype=torch.bool)
    top[0, flat[0].topk(k).indices] = True
    kept = top.reshape(1, 2, 2, t).permute(1, 0, 2, 3)
    terms = ranking_loss(log_betas, kept)
    assert terms.agreement.item() == pytest.approx(1.0)
    # the opposite set: no agreement, a larger loss
    worst = torch.zeros_like(flat, dtype=torch.bool)
    worst[0, flat[0].topk(k, largest=False).indices] = True
    far = ranking_loss(log_betas, worst.reshape(1, 2, 2, t).permute(1, 0, 2, 3))
    assert far.agreement.item() == 0.0 and far.loss.item() > terms.loss.item()


def test_per_layer_ranking_draws_a_line_in_each_layer():
    # layer 0 scores every entry far below layer 1: ranked together, layer 1 takes the whole budget; ranked per
    # layer, each keeps its own top entries, and a teacher set with a share of each layer is matched exactly
    log_betas = [torch.full((1, 2, 10), -2.0), torch.full((1, 2, 10), -0.01)]
    log_betas[0][0, 0, 3] = -0.1
    log_betas[1][0, 1, 4] = -0.001
    kept = torch.zeros(2, 1, 2, 10, dtype=torch.bool)
    kept[0, 0, 0, 3] = kept[0, 0, :, 9] = True  # layer 0: its best old entry and the newest ones
    kept[1, 0, 1, 4] = kept[1, 0, :, 9] = True
    assert ranking_loss(log_betas, kept, per_layer=True).agreement.item() == pytest.approx(1.0)
    assert ranking_loss(log_betas, kept).agreement.item() < 1.0


def test_ranking_loss_raises_the_retention_of_what_the_teacher_keeps():
    log_betas = _log_betas()
    kept = torch.zeros(2, 1, 2, 10, dtype=torch.bool)
    kept[1, 0, 0, 2] = True  # an old entry of layer 1, head 0
    kept[0, 0, 1, 5] = True
    ranking_loss(log_betas, kept).loss.backward()
    grad = log_betas[1].grad
    assert grad[0, 0, 2] < 0  # descending the loss raises log beta there: kept longer
    assert log_betas[0].grad[0, 1, 5] < 0
    # the last entry has age 0: its score does not depend on beta, so it gets no gradient
    assert log_betas[0].grad[0, :, -1].abs().max() == 0


def test_ranking_loss_cannot_be_lowered_by_scaling_every_retention():
    # every log beta times one factor ranks the same entries: the loss must not move (no way out that ranks nothing)
    log_betas = _log_betas(requires_grad=False)
    kept = torch.zeros(2, 1, 2, 10, dtype=torch.bool)
    kept[..., 9] = True  # the newest entries, and four older ones
    kept[0, 0, 0, 1] = kept[1, 0, 1, 3] = kept[1, 0, 0, 6] = kept[0, 0, 1, 2] = True
    base = ranking_loss(log_betas, kept).loss.item()
    for factor in (0.01, 0.3, 5.0):
        scaled = ranking_loss([lb * factor for lb in log_betas], kept).loss.item()
        assert scaled == pytest.approx(base, rel=0.02)


def test_ranking_loss_refuses_a_mismatched_set():
    with pytest.raises(ValueError, match="does not match the gates"):
        ranking_loss(_log_betas(), torch.zeros(2, 1, 2, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        ranking_loss(_log_betas(), torch.zeros(2, 1, 2, 10, dtype=torch.bool), temperature=0)


def test_training_with_the_teacher_logs_its_loss_and_agreement(tmp_path, llama):
    model, proc = llama
    text = tmp_path / "book.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good "
                    "fortune, must be in want of a wife. " * 8)
    out = tmp_path / "gates"
    cfg = TrainConfig(model=model, processor=proc, data=[str(text)], out=str(out), budget_range=(0.2, 0.2),
                      global_budget=True, max_length=48, steps=3, lr=3e-2, warmup=0, width=8, init_bias=4.0,
                      progress=False, save_every=1, teacher_weight=1.0)
    train_gates(cfg)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    assert all(ln["teacher_loss"] > 0 and 0 <= ln["teacher_agreement"] <= 1 for ln in lines)
    assert load_gates(str(out)).config.training["teacher"]["weight"] == 1.0
    with pytest.raises(ValueError, match="teacher_weight must be >= 0"):
        train_gates(TrainConfig(**{**cfg.__dict__, "teacher_weight": -1.0, "out": str(tmp_path / "x")}))


def test_cli_flags_reach_the_config():
    from vlm_kv.train.cli import config_from_args

    from vlm_kv.cli.main import build_parser

    args = build_parser().parse_args(["train-gates", "--data", "x.txt", "--budget-range", "0.05,0.3", "--steps", "1",
                                      "--out", "o", "--teacher-weight", "0.5", "--teacher-temperature", "2"])
    cfg = config_from_args(args)
    assert (cfg.teacher_weight, cfg.teacher_temperature) == (0.5, 2.0)
    assert config_from_args(build_parser().parse_args(
        ["train-gates", "--data", "x.txt", "--budget-tokens", "8", "--steps", "1", "--out", "o"])).teacher_weight == 0.0
