"""PolyKV per-modality shares: within a layer, a modality's entries beyond its share of the
layer's budget are evicted first (by score); the share of a modality with too few entries goes
to the others; the whole cache still holds the global budget."""
from types import SimpleNamespace

import pytest
import torch

import vlm_kv
from vlm_kv.config import Budget
from vlm_kv.eviction.evictor import Evictor
from vlm_kv.models.adapters import get_adapter
from vlm_kv.policies import PolyKV, PolyKVAllocation
from vlm_kv.policies.polykv import modality_quotas, split_by_modality
from vlm_kv.storage.store import VarlenKVStore
from vlm_kv.policies.strategy import LayerEntry, Strategy
from vlm_kv.testing import tiny_inputs, tiny_model

N, D = 40, 4


def _layer(strength: torch.Tensor, modality: torch.Tensor) -> SimpleNamespace:
    """One head whose entries received ``strength`` attention (H2O's state)."""
    store = VarlenKVStore(1, 1, D, torch.float32, torch.device("cpu"), state_names=("attn_sum",))
    store.append(torch.randn(1, 1, N, D), torch.randn(1, 1, N, D), torch.arange(N), modality.view(1, N).to(torch.uint8),
                 torch.ones(1, N, dtype=torch.bool))
    store.add_state("attn_sum", strength.view(1, 1, N).clone())
    return SimpleNamespace(layer_idx=0, store=store, window_queries=None, window_positions=None, scaling=1.0, seen=N)


def _evict(layer, modality_shares, budget, pattern="h2o"):
    strategy = Strategy(model={"family": "test", "config_hash": "x", "num_layers": 1}, budget=budget,
                        layers={"prefill": [LayerEntry(pattern, budget, modality=modality_shares)]}).validate()
    evictor = Evictor(PolyKV(strategy=strategy), PolyKVAllocation(strategy=strategy), Budget(fraction=budget))
    assert evictor.due(N)
    evictor.evict([layer], SimpleNamespace(valid_tokens=torch.tensor([N]), first_positions=torch.tensor([0])))
    view = layer.store.padded_view()
    return set(view.positions[view.valid].tolist())


def test_quotas_split_by_share_and_pass_on_what_a_modality_cannot_use():
    shares = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    assert modality_quotas(torch.tensor([30, 30, 0]), shares, torch.tensor(20)).tolist() == [10, 10, 0]
    # images hold only 4: their unused 6 go to text
    assert modality_quotas(torch.tensor([30, 4, 0]), shares, torch.tensor(20)).tolist() == [16, 4, 0]
    # a modality with no share gets nothing; video absent: its share goes to the others
    three = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)
    assert modality_quotas(torch.tensor([30, 30, 0]), three, torch.tensor(20)).tolist() == [10, 10, 0]
    assert modality_quotas(torch.tensor([[30, 30, 5]]), three, torch.tensor([20])).tolist() == [[7, 7, 5]]


def test_a_modality_beyond_its_share_is_evicted_first_by_score():
    modality = torch.zeros(N, dtype=torch.long)
    modality[10:30] = 1                        # 20 image entries in the middle
    strength = torch.arange(N, dtype=torch.float32) / N
    strength[10:30] += 10.0                     # images received far more attention than any text
    # h2o at 16 entries: 8 recent (protected, text) + 8 heavy hitters; without shares all 8 are images
    assert _evict(_layer(strength, modality), None, 0.4) == set(range(32, N)) | set(range(22, 30))
    # images may hold a quarter of the layer (4 of 16): the 4 best images, then the best text
    # (the protected recent text counts in the text share)
    kept = _evict(_layer(strength, modality), {"text": 0.75, "image": 0.25}, 0.4)
    assert kept == set(range(32, N)) | set(range(26, 30)) | {8, 9, 30, 31}
    # no images present: the image share goes to text, and the pattern keeps what it keeps alone
    text_only = torch.zeros(N, dtype=torch.long)
    assert _evict(_layer(strength, text_only), {"text": 0.5, "image": 0.5}, 0.4) == \
        _evict(_layer(strength, text_only), None, 0.4)


def test_split_by_modality_keeps_order_within_each_tier_and_empty_slots():
    scores = torch.tensor([[[5.0, 4.0, 3.0, 2.0, 1.0, float("-inf")]]])
    modality = torch.tensor([[[1, 1, 1, 0, 0, 0]]], dtype=torch.uint8)
    valid = torch.tensor([[[True] * 5 + [False]]])
    out = split_by_modality(scores, modality, valid, {"text": 0.5, "image": 0.5}, torch.tensor([4]), per_head=True)
    # quotas 2 / 2: images 5, 4 and texts 2, 1 first (in score order), then the surplus image 3
    order = torch.argsort(out[0, 0, :5], descending=True).tolist()
    assert order == [0, 1, 3, 4, 2]
    assert torch.isneginf(out[0, 0, 5])


@pytest.mark.parametrize("pattern", ["tova", "adakv"])
def test_tiny_vlm_keeps_the_image_share_and_the_global_budget(pattern):
    model = tiny_model("qwen2_5_vl", num_layers=2)
    inputs = tiny_inputs(model, num_images=2, text_len=120)  # AdaKV protects 32 recent: cap must exceed it
    modality = get_adapter(model).modality_of(inputs["input_ids"])[0]
    n = int(modality.numel())
    n_image = int((modality == 1).sum())
    budget, image_share = 0.4, 0.25
    fp = get_adapter(model).fingerprint()
    entries = [LayerEntry(pattern, budget / 2, modality={"text": 1 - image_share, "image": image_share})
               for _ in range(2)]
    strategy = Strategy(model=fp, budget=budget, layers={"prefill": entries}).validate()
    cache = vlm_kv.make_cache(model, policy="polykv", budget=budget, strategy=strategy,
                              options=vlm_kv.CacheOptions(evict_every=4))
    with torch.no_grad():
        model(**inputs, past_key_values=cache, use_cache=True)
    cap = int(budget * n)
    heads = model.config.get_text_config().num_key_value_heads
    assert n_image > image_share * cap and n - n_image > cap  # both modalities compete for the layer
    for layer in cache.layers:
        view = layer.store.padded_view()
        images = (view.modality == 1) & view.valid
        # TOVA: a quota per head; AdaKV: one over the layer's heads together. Flooring the quotas
        # leaves at most one slot per group, taken by score whatever its modality
        if pattern == "tova":
            groups, quota = images.sum(-1).flatten().tolist(), int(image_share * cap)
        else:
            groups, quota = [int(images.sum())], int(image_share * cap * heads)
        assert all(quota <= g <= quota + 1 for g in groups), (groups, quota)
    assert cache.kv_bytes()["total"] <= cache.budget_bytes()
    # the share decides, not the scores: no image share keeps no image; a share larger than the
    # images keeps them all (the rest of it goes to text), and the budget holds either way
    for share, expected in ((0.0, 0), (0.75, n_image * heads)):
        entries = [LayerEntry(pattern, budget / 2, modality={"text": 1 - share, "image": share}) for _ in range(2)]
        other = vlm_kv.make_cache(model, policy="polykv", budget=budget,
                                  strategy=Strategy(model=fp, budget=budget, layers={"prefill": entries}).validate())
        with torch.no_grad():
            model(**inputs, past_key_values=other, use_cache=True)
        for layer in other.layers:
            view = layer.store.padded_view()
            assert int(((view.modality == 1) & view.valid).sum()) == expected
            assert int(view.valid.sum()) == cap * heads
