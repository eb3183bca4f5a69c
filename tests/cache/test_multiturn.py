"""A second turn (new text and a new image) prefilled on top of a compressed cache sees the
same positions (M-RoPE for Qwen) as the same turns on an uncompressed cache."""
import pytest
import torch
from transformers import DynamicCache

import vlm_kv
from vlm_kv.config import CacheOptions
from vlm_kv.testing import tiny_inputs, tiny_model


def _rotary_positions(model):
    seen = []
    rotary = next(m for name, m in model.named_modules() if name.endswith("language_model.rotary_emb"))

    def hook(module, args, kwargs):
        pos = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        seen.append(pos.detach().clone())

    return seen, rotary.register_forward_pre_hook(hook, with_kwargs=True)


def _two_turns(model, cache, turn1, turn2, answer):
    """Turn 1 prefill + 4 forced answer tokens, then turn 2 (new image) prefill + 6 decode steps."""
    # batch 1 without padding: no attention mask, so every model derives positions from the
    # cache length (Qwen adds its stored rope deltas), as generate does
    out = []
    with torch.no_grad():
        model(**{k: v for k, v in turn1.items() if k != "attention_mask"}, past_key_values=cache, use_cache=True)
        for tok in answer:
            model(input_ids=tok.view(1, 1), past_key_values=cache, use_cache=True)
        extra = {k: v for k, v in turn2.items() if k != "attention_mask"}
        logits = model(**extra, past_key_values=cache, use_cache=True).logits
        tok = logits[:, -1:].argmax(-1)
        for _ in range(6):
            logits = model(input_ids=tok, past_key_values=cache, use_cache=True).logits
            tok = logits[:, -1:].argmax(-1)
            out.append(tok)
    return out


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "llava"])
def test_second_turn_positions_match_uncompressed_run(family):
    model = tiny_model(family)
    turn1 = tiny_inputs(model, num_images=1, text_len=10, seed=0)
    turn2 = tiny_inputs(model, num_images=1, text_len=8, seed=1)
    answer = torch.randint(5, 50, (4,), generator=torch.Generator().manual_seed(3))

    ref_pos, handle = _rotary_positions(model)
    _two_turns(model, DynamicCache(config=model.config), turn1, turn2, answer)
    handle.remove()

    cache = vlm_kv.make_cache(model, policy="snapkv", budget=0.3,
                              options=CacheOptions(evict_every=2, scorer_kwargs={"window": 4}))
    pos, handle = _rotary_positions(model)
    _two_turns(model, cache, turn1, turn2, answer)
    handle.remove()

    assert cache.eviction_steps >= 4 and cache.evicted_entries > 0
    assert len(pos) == len(ref_pos)
    for a, b in zip(pos, ref_pos):
        assert torch.equal(a, b)
    if family.startswith("qwen"):
        assert ref_pos[0].shape[0] in (3, 4)  # M-RoPE: temporal/height/width (+text) sections
    # every entry kept remembers where it came from, across both turns
    store = cache.layers[0].store
    view = store.padded_view()
    kept = view.positions[view.valid]
    assert int(kept.max()) == cache.get_seq_length() - 1 and int(kept.min()) >= 0
    assert cache.stats()["per_modality"]["image"] > 0


def test_reset_empties_the_cache_for_a_new_conversation():
    model = tiny_model("llama", num_layers=2)
    ids = torch.randint(16, 200, (1, 60), generator=torch.Generator().manual_seed(7))
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=0.25, options=CacheOptions(scorer_kwargs={"window": 4}))
    model(input_ids=ids[:, :40], cache=cache)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.num_entries() == 0 and cache.valid_tokens is None
    fresh = vlm_kv.make_cache(model, policy="snapkv", budget=0.25, options=CacheOptions(scorer_kwargs={"window": 4}))
    torch.testing.assert_close(model(input_ids=ids, cache=cache).logits, model(input_ids=ids, cache=fresh).logits)
    assert cache.kv_bytes()["total"] == fresh.kv_bytes()["total"]
