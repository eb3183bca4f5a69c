"""R-KV, FastV and VisionZip keep what their definitions say.

Hand-built stores: keys in D = 64 are random (pairwise cosines far below R-KV's 0.5
threshold) except where a test plants duplicates or the query's favourite keys. Then the
visual pruners on tiny VLMs with images: text entries are never touched.
"""
import pytest
import torch

import vlm_kv
from vlm_kv.storage.allocation import Uniform
from vlm_kv.models.adapters import get_adapter
from vlm_kv.policies.fastv import FastV
from vlm_kv.policies.rkv import RKV
from vlm_kv.policies.visionzip import VisionZip
from vlm_kv.policies.base import ScoreContext, protect
from vlm_kv.storage.store import VarlenKVStore
from vlm_kv.testing import tiny_inputs, tiny_model

N, D = 40, 64


def _store(keys: torch.Tensor, modality: torch.Tensor | None = None) -> VarlenKVStore:
    heads = keys.shape[1]
    store = VarlenKVStore(1, heads, D, torch.float32, torch.device("cpu"))
    n = keys.shape[2]
    mod = torch.zeros(1, n, dtype=torch.uint8) if modality is None else modality[None].to(torch.uint8)
    store.append(keys, torch.randn(1, heads, n, D), torch.arange(n), mod, torch.ones(1, n, dtype=torch.bool))
    return store


def _random_keys(heads=1, n=N, seed=0):
    return torch.randn(1, heads, n, D, generator=torch.Generator().manual_seed(seed))


def _scores(scorer, store, cap, queries, layer_idx=0, num_layers=1, seen=None):
    view = store.padded_view()
    n = int(view.positions.max()) + 1 if seen is None else seen
    qpos = torch.arange(n - queries.shape[2], n)
    ctx = ScoreContext(layer_idx, num_layers, view, queries, qpos, D ** -0.5, n, torch.tensor([cap]),
                       torch.Generator().manual_seed(0))
    scores = scorer.score(ctx)
    return view, protect(scores, view, scorer.sinks, torch.tensor([scorer.protected_window(cap)]),
                         torch.tensor([0]), n)


def _keep(scorer, store, cap, queries, **kw):
    view, scores = _scores(scorer, store, cap, queries, **kw)
    keep = Uniform().keep_layer(scores, torch.tensor([cap]))
    return [set(view.positions[0, h][keep[0, h]].tolist()) for h in range(keep.shape[1])]


def _query_towards(keys, targets, n=1, strength=20.0):
    """Plants a shared direction u in the ``targets`` keys (all heads) and returns queries along
    u: logits ~ 20 for the targets, ~ +-2.5 for the random rest."""
    u = torch.nn.functional.normalize(torch.randn(D, generator=torch.Generator().manual_seed(123)), dim=0)
    for t in targets:
        keys[0, :, t] = keys[0, :, t] * 0.1 + 8 * u
    return (u * strength).expand(1, keys.shape[1], n, D).clone()


# ------------------------------------------------------------------ R-KV

def _with_duplicates(dups=range(10, 16)):
    keys = _random_keys()
    base = keys[0, 0, dups[0]].clone()
    for j, i in enumerate(dups):  # near-copies of one key
        keys[0, 0, i] = base + 0.01 * j
    return keys


def test_rkv_redundancy_evicts_near_copies_but_keeps_the_latest():
    keys = _with_duplicates()
    q = torch.randn(1, 1, 8, D, generator=torch.Generator().manual_seed(5)) * 0.01  # attention ~ uniform
    kept = _keep(RKV(mix_lambda=0.0, kernel=1), _store(keys), cap=N - 5, queries=q)[0]
    assert kept == set(range(N)) - {10, 11, 12, 13, 14}


def test_rkv_importance_alone_keeps_the_attended_entries():
    keys = _random_keys()
    q = _query_towards(keys, [5, 21], n=8)
    kept = _keep(RKV(mix_lambda=1.0, kernel=1), _store(keys), cap=10, queries=q)[0]
    assert kept == {5, 21} | set(range(N - 8, N))


def test_rkv_mix_keeps_attended_and_latest_copy_drops_copies():
    keys = _with_duplicates()
    q = _query_towards(keys, [5], n=8)
    kept = _keep(RKV(), _store(keys), cap=N - 5, queries=q)[0]  # lambda 0.07, kernel 7
    assert {5, 15} <= kept and not kept & {10, 11, 12, 13, 14}
    assert set(range(N - 8, N)) <= kept


def test_rkv_parameters_checked():
    with pytest.raises(ValueError, match="mix_lambda"):
        RKV(mix_lambda=1.5)


# ------------------------------------------------------------------ FastV

IMAGE = list(range(10, 30))


def _modality():
    m = torch.zeros(N, dtype=torch.uint8)
    m[IMAGE] = 1
    return m


def test_fastv_drops_the_least_attended_half_of_the_image_from_layer_k_only():
    keys = _random_keys(heads=2)
    liked = [12, 15, 16, 20, 22, 23, 25, 27, 28, 29]
    q = _query_towards(keys, liked)
    scorer = FastV(layer=2, drop_ratio=0.5)
    early = _keep(scorer, _store(keys, _modality()), cap=N, queries=q, layer_idx=1, num_layers=4)
    assert early == [set(range(N))] * 2
    kept = _keep(scorer, _store(keys, _modality()), cap=N, queries=q, layer_idx=2, num_layers=4)
    text = set(range(N)) - set(IMAGE)
    assert kept == [text | set(liked)] * 2


def test_fastv_judges_each_image_once():
    keys = _random_keys()
    liked = [12, 15, 16, 20, 22, 23, 25, 27, 28, 29]
    scorer = FastV(layer=0, drop_ratio=0.5)
    store = _store(keys, _modality())
    view, scores = _scores(scorer, store, N, _query_towards(keys, liked))
    store.compact(Uniform().keep_layer(scores, torch.tensor([N])), None)
    assert store.num_entries() == N - 10
    # a later eviction step (more tokens seen, a query that likes other entries) drops nothing more
    later = _query_towards(keys, [12, 15])
    view, scores = _scores(scorer, store, N, later, seen=N + 5)
    assert not bool((scores[view.valid] == float("-inf")).any())


def test_fastv_refuses_a_budget_that_cannot_hold_the_text():
    keys = _random_keys()
    with pytest.raises(ValueError, match="never evicts text"):
        _keep(FastV(layer=0), _store(keys, _modality()), cap=10, queries=_query_towards(keys, [12]))


# ------------------------------------------------------------------ VisionZip

def test_visionzip_keeps_dominant_tokens_and_one_per_context_group():
    keys = _random_keys()
    # two tight clusters among the non-dominant image tokens: 10-19 and 20-27
    a, b = torch.randn(2, D, generator=torch.Generator().manual_seed(9))
    for i in range(10, 20):
        keys[0, 0, i] = a + 0.05 * torch.randn(D, generator=torch.Generator().manual_seed(i))
    for i in range(20, 28):
        keys[0, 0, i] = b + 0.05 * torch.randn(D, generator=torch.Generator().manual_seed(i))
    q = _query_towards(keys, [28, 29], n=4)  # 28, 29: the dominant ones
    scorer = VisionZip(dominant_ratio=0.1, contextual_ratio=0.1, window=4)
    kept = _keep(scorer, _store(keys, _modality()), cap=N, queries=q)[0]
    text = set(range(N)) - set(IMAGE)
    image_kept = kept - text
    assert text <= kept and {28, 29} <= image_kept and len(image_kept) == 4
    # one representative per cluster
    assert len(image_kept & set(range(10, 20))) == 1 and len(image_kept & set(range(20, 28))) == 1


def test_visionzip_representative_is_the_member_nearest_the_group_mean():
    scorer = VisionZip(dominant_ratio=0.25, contextual_ratio=0.25)
    keys = torch.zeros(8, 3)
    keys[:, 0] = 1.0
    keys[1:4, 1] = torch.tensor([0.3, 0.02, -0.25])  # group around token 2
    keys[4:8, 2] = torch.tensor([0.4, 0.1, -0.05, -0.3])
    attn = torch.tensor([9.0, 0, 0, 0, 0, 0, 0, 5.0])
    dominant, reps = scorer.select(attn, keys)
    assert set(dominant.tolist()) == {0, 7}
    assert len(reps) == 2 and set(reps.tolist()) <= set(range(1, 7))


# ------------------------------------------------------------------ tiny VLMs with images

@pytest.mark.parametrize("policy,kwargs", [("fastv", {"layer": 1}), ("visionzip", {"window": 4})])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_visual_pruners_on_tiny_vlms_leave_text_alone(family, policy, kwargs):
    model = tiny_model(family)
    inputs = tiny_inputs(model, num_images=2, text_len=16)
    modality = get_adapter(model).modality_of(inputs["input_ids"])[0]
    n_text, n_image = int((modality == 0).sum()), int((modality != 0).sum())
    cache = vlm_kv.make_cache(model, policy, budget=1.0, options=vlm_kv.CacheOptions(scorer_kwargs=kwargs))
    with torch.no_grad():
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4
    text_ids = torch.nonzero(modality == 0).flatten().tolist()
    for layer in cache.layers:
        view = layer.store.padded_view()
        for h in range(view.positions.shape[1]):
            pos = view.positions[0, h][view.valid[0, h]]
            mods = view.modality[0, h][view.valid[0, h]]
            assert set(text_ids) <= set(pos.tolist())  # every prompt text token is still there
            images_left = int((mods != 0).sum())
            if policy == "fastv" and layer.layer_idx < 1:
                assert images_left == n_image
            elif policy == "fastv":
                assert images_left == n_image - n_image // 2
            else:
                n_dom = max(1, round(54 / 576 * n_image))
                assert images_left == n_dom + min(n_image - n_dom, round(10 / 576 * n_image))
    assert n_text > 0
