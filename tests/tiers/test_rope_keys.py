"""Pre-RoPE INT2 keys: rotating back and forth matches the model's own rotary embedding."""
import pytest
import torch

import vlm_kv
from vlm_kv.testing import record_evictions, tiny_model
from vlm_kv.tiers.rope_keys import KeyRotation


def test_rotation_matches_the_model_rotary_and_inverts():
    model = tiny_model("llama")
    rotation = KeyRotation.from_model(model, uses_mrope=False)
    rotary = dict(model.named_modules())["model.rotary_emb"]
    keys = torch.randn(5, 16)
    positions = torch.tensor([0, 3, 17, 100, 1000])
    cos, sin = rotary(keys[None], positions[None])
    half = torch.cat([-keys[:, 8:], keys[:, :8]], dim=-1)
    torch.testing.assert_close(rotation.rotate(keys, positions), keys * cos[0] + half * sin[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotation.unrotate(rotation.rotate(keys, positions), positions), keys, rtol=1e-5, atol=1e-5)


def test_pre_rope_tiers_hold_the_budget_and_attend_rotated_keys():
    model = tiny_model("llama")
    tokens = torch.randint(5, model.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))
    caches = {}
    for key_rope in ("post", "pre"):
        cache = vlm_kv.make_cache(model, policy="h2o", budget=0.3, tiers={"key_rope": key_rope})
        steps = record_evictions(cache)
        with torch.no_grad():
            model(input_ids=tokens[:, :80], past_key_values=cache, use_cache=True)
            for i in range(80, 96):
                model(input_ids=tokens[:, i : i + 1], past_key_values=cache, use_cache=True)
        assert all(held <= allowed for held, allowed in steps)
        caches[key_rope] = cache
    # the codes are pre-RoPE: each dequantized key is within half a step (per channel) of the true
    # key rotated back to its position (layer 0's keys depend only on token and position)
    from transformers import DynamicCache

    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=tokens, past_key_values=full, use_cache=True)
    tier = caches["pre"].layers[0].tier
    assert tier.num_active > 0
    keys, _ = tier.codes.dequantize(torch.float32)
    rotation = tier.rope
    H = model.config.num_key_value_heads
    for i in range(len(tier)):
        h = int(tier.row[i]) % H
        for t in range(tier.window):
            p = int(tier.positions[i, t])
            if p < 0:
                continue
            true_pre = rotation.unrotate(full.layers[0].keys[0, h, p], torch.tensor(p))
            bound = tier.codes.key_scale[i].float() / 2 + 1e-3
            assert ((keys[i, t] - true_pre).abs() <= bound).all()
    with pytest.raises(ValueError, match="M-RoPE"):
        vlm_kv.make_cache(tiny_model("qwen2_vl"), policy="h2o", budget=0.3, tiers={"key_rope": "pre"})


def test_pre_rope_keys_in_the_hadamard_basis_come_back_within_the_grid_bound():
    from transformers import DynamicCache

    model = tiny_model("llama")
    tokens = torch.randint(5, model.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(1))
    cache = vlm_kv.make_cache(model, policy="h2o", budget=0.3, tiers={"key_rope": "pre", "basis": "hadamard"})
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=tokens[:, :80], past_key_values=cache, use_cache=True)
        model(input_ids=tokens[:, :80], past_key_values=full, use_cache=True)
    tier = cache.layers[0].tier
    assert tier.num_active > 0 and tier.rotated and not tier.kernel_readable
    with pytest.raises(ValueError, match="in_basis=True needs post-RoPE codes"):
        tier.view(in_basis=True)  # pre-RoPE keys cannot be attended with a rotated query alone
    idx = torch.arange(len(tier))
    keys, _ = tier.dequantize(idx)  # back in the model's space: out of the basis, RoPE applied again
    scale, _ = tier.codes.key_grid(idx)
    H = model.config.num_key_value_heads
    for i in range(len(tier)):
        # both rotations keep norms, so the half-step bound per rotated channel bounds the error norm
        bound = float((scale[i].float() / 2).norm()) + 1e-3
        for t in range(tier.window):
            p = int(tier.positions[i, t])
            if p >= 0:
                assert float((keys[i, t].float() - full.layers[0].keys[0, int(tier.row[i]) % H, p]).norm()) <= bound
