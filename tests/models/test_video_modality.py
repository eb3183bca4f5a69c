"""Video tokens are tagged `video` in the cache: stats, bytes, and the dbtrimkv modality floors/caps.

Tiny random Qwen2.5-VL / Qwen3-VL / LLaVA-OneVision with synthetic frames (``tiny_inputs(num_videos=1)``).
"""

import pytest
import torch

import vlm_kv
from vlm_kv.gates.retention_gate import GateConfig, RetentionGates
from vlm_kv.models.adapters import VIDEO, get_adapter
from vlm_kv.testing import tiny_inputs, tiny_model

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "llava_onevision")
LAYERS, KV_HEADS, HEAD_DIM, FP32 = 2, 2, 16, 4


def _gates(model):
    a = get_adapter(model)
    torch.manual_seed(0)
    g = RetentionGates(GateConfig(kind="dbtrimkv", hidden_size=a.hidden_size, num_layers=a.num_layers,
                                  num_kv_heads=a.num_kv_heads, width=16, init_bias=1.0, model=a.fingerprint()))
    for p in g.parameters():  # spread the rates so eviction has choices to make
        torch.nn.init.normal_(p, std=1.0)
    return g


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    model = tiny_model(request.param)
    inputs = tiny_inputs(model, num_images=0, num_videos=1, num_frames=4, text_len=16)
    return request.param, model, inputs


def test_video_tokens_are_counted_as_video(family_model):
    family, model, inputs = family_model
    n_video = int((get_adapter(model).modality_of(inputs["input_ids"]) == VIDEO).sum())
    assert n_video == {"qwen2_5_vl": 8, "qwen3_vl": 8, "llava_onevision": 17}[family]
    cache = vlm_kv.make_cache(model, policy="streaming_llm", budget=1.0)
    with torch.no_grad():
        model(**inputs, past_key_values=cache)
    stats, nbytes = cache.stats(), cache.kv_bytes()
    assert stats["per_modality"]["video"] == n_video * LAYERS * KV_HEADS
    assert stats["per_modality"]["image"] == 0
    assert nbytes["per_modality"]["video"] == stats["per_modality"]["video"] * 2 * HEAD_DIM * FP32


@pytest.mark.parametrize("kwargs, holds", [
    ({"modality_floor": {"video": 0.6}}, lambda video, total: video >= int(0.6 * total)),
    ({"modality_cap": {"video": 0.1}}, lambda video, total: video <= int(0.1 * total)),
])
def test_dbtrimkv_video_floor_and_cap(family_model, kwargs, holds):
    _, model, inputs = family_model
    cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.4, gates=_gates(model),
                              options=vlm_kv.CacheOptions(allocation_kwargs=kwargs))
    with torch.no_grad():
        model(**inputs, past_key_values=cache)
    stats = cache.stats()
    total = stats["entries"]
    assert total == int(0.4 * inputs["input_ids"].shape[1]) * LAYERS * KV_HEADS
    assert holds(stats["per_modality"]["video"], total), stats["per_modality"]
    assert cache.kv_bytes()["per_modality"]["video"] == stats["per_modality"]["video"] * 2 * HEAD_DIM * FP32


def test_generate_with_video_on_a_compressed_cache(family_model):
    _, model, inputs = family_model
    cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.6, gates=_gates(model),
                              options=vlm_kv.CacheOptions(allocation_kwargs={"modality_floor": {"video": 0.3}}))
    out = model.generate(**inputs, cache=cache, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3
    assert cache.stats()["per_modality"]["video"] > 0
