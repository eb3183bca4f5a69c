"""``vlm-kv demo --image``: the kept-patch map, the PNG, and the checks before any model work. Runs
smollava's architecture around a tiny random language model with SmolLM2's tokenizer (code paths;
the real model's run is in docs/smollava/demo.png)."""

import numpy as np
import pytest
import torch
from PIL import Image

import vlm_kv.cli.demo_image as demo_image
from vlm_kv import make_cache
from vlm_kv.cli.demo_image import (
    ImageDemoSettings,
    demo_item,
    kept_patch_counts,
    png_size,
    prompt_ids,
    render_png,
    run_image_demo,
)
from vlm_kv.cli.main import main
from vlm_kv.eval.visual_qa import answer
from vlm_kv.eval.visual_tasks import GRID
from vlm_kv.models.adapters import IMAGE
from vlm_kv.models.smollava import IMAGE_TOKEN_ID, IMAGE_TOKENS
from vlm_kv.policies.catalog import UnknownPolicyError

LAYERS = 2  # the tiny language model: 2 layers, 1 KV head


@pytest.fixture(scope="module")
def tiny(smollm2):
    from transformers import LlamaConfig, LlamaForCausalLM

    from vlm_kv.models.smollava import build_smollava

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                                      max_position_embeddings=4096, pad_token_id=2))
    yield build_smollava(lm, smollm2[1])
    torch.set_num_threads(before)


def _settings(tmp_path, **kw) -> ImageDemoSettings:
    base = dict(policy="snapkv", budget=0.25, data_seed=1, images=2, max_new_tokens=3, png=tmp_path / "demo.png")
    return ImageDemoSettings(**{**base, **kw})


def test_patch_counts_mark_exactly_the_kept_visual_entries(tiny, tmp_path):
    model, processor = tiny
    settings = _settings(tmp_path)
    item = demo_item(settings)
    ids = prompt_ids(processor.tokenizer, item)
    cache = make_cache(model, "snapkv", 0.25)
    answer(model, processor.tokenizer, item, 3, cache=cache)
    counts = kept_patch_counts(cache, ids, IMAGE_TOKEN_ID, 2, pairs=LAYERS)
    assert counts.shape == (2, GRID, GRID)

    # the same map built the slow way: per (layer, head), the set of prompt positions it holds
    image_positions = [p for p, t in enumerate(ids.tolist()) if t == IMAGE_TOKEN_ID]
    assert len(image_positions) == 2 * IMAGE_TOKENS
    expected = np.zeros(2 * IMAGE_TOKENS, dtype=np.int64)
    for layer in cache.layers:
        held, _ = layer.held_positions()
        for head in held[0]:
            kept = set(head.tolist())
            expected += np.array([p in kept for p in image_positions])
    assert np.array_equal(counts.reshape(-1), expected)
    # and against the store's own modality bookkeeping: every image entry held is on the map once
    assert counts.sum() == sum(int(layer.store.modality_counts()[IMAGE]) for layer in cache.layers)
    # a budget of 0.25 evicts visual entries but not all of them
    assert 0 < counts.sum() < 2 * IMAGE_TOKENS * LAYERS

    # the demo reports this map as shares of the (layer, head) pairs
    result = run_image_demo(settings, loaded=tiny, verbose=False)
    assert result.pairs == LAYERS
    assert result.kept.shape == (2, GRID, GRID)
    assert np.array_equal(result.kept * LAYERS, counts)
    assert result.compressed_bytes < result.full_bytes


def test_png_has_both_rows_and_frames_the_asked_image(tiny, tmp_path):
    result = run_image_demo(_settings(tmp_path), loaded=tiny, verbose=False)
    assert png_size(2) == (2 * 448 + 3 * 12, 52 + 2 * (22 + 448) + 12 + 40)
    with Image.open(result.png) as png:
        assert png.format == "PNG" and png.size == png_size(2)
        canvas = np.asarray(png.convert("RGB"))
    asked = result.asked_image
    side, pad, top = 448, 12, 52 + 22
    for k in range(2):
        x = pad + k * (side + pad)
        frame = tuple(canvas[top + side // 2, x - 2])
        assert frame == ((220, 30, 30) if k == asked else (255, 255, 255))
    # an image no (layer, head) pair kept is drawn dark, one every pair kept is drawn as it is
    images = [Image.new("RGB", (224, 224), (200, 200, 200))] * 2
    kept = np.zeros((2, GRID, GRID))
    kept[1] = 1.0
    render_png(images, kept, 0, tmp_path / "ramp.png", ["t"])
    canvas = np.asarray(Image.open(tmp_path / "ramp.png").convert("RGB"))
    lower = 52 + 22 + side + 22 + side // 2
    assert canvas[lower, pad + side // 2].max() < 40
    assert tuple(canvas[lower, 2 * pad + side + side // 2]) == (200, 200, 200)
    with pytest.raises(ValueError, match="shape"):
        render_png(images, kept[:1], 0, tmp_path / "bad.png", ["t"])


def test_budget_one_keeps_every_patch_and_answers_the_same(tiny, tmp_path):
    for policy in ("snapkv", "full"):
        result = run_image_demo(_settings(tmp_path, policy=policy, budget=1.0), loaded=tiny, verbose=False)
        assert np.all(result.kept == 1.0)
        assert result.compressed_answer == result.full_answer
        canvas = np.asarray(Image.open(result.png).convert("RGB"))
        side, pad, top = 448, 12, 52 + 22
        upper = canvas[top:top + side, pad:pad + side]
        lower = canvas[top + side + 22:top + 2 * side + 22, pad:pad + side]
        assert np.array_equal(upper, lower)  # every patch kept: the lower panel is the image itself


def test_bad_arguments_fail_before_any_model_work(tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(demo_image, "load_model_and_processor", refuse)
    monkeypatch.setattr(demo_image, "make_item", refuse)
    with pytest.raises(UnknownPolicyError, match="unknown policy 'magic'"):
        run_image_demo(_settings(tmp_path, policy="magic"))
    with pytest.raises(ValueError, match="images"):
        run_image_demo(_settings(tmp_path, images=0))
    assert main(["demo", "--image", "--policy", "magic", "--png", str(tmp_path / "x.png")]) == 2
    assert "unknown policy 'magic'" in capsys.readouterr().err
    assert main(["demo", "--image", "--images", "0"]) == 2
    assert main(["demo", "--image", "--budget", "1.5"]) == 2
    assert main(["demo", "--png", str(tmp_path / "x.png")]) == 2  # an image flag without --image
    assert "only with --image" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
