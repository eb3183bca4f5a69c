"""RetentionScorer's ``span``: each entry scores the best retention among the entries centred on it."""
import pytest
import torch

import vlm_kv
from vlm_kv.config import CacheOptions
from vlm_kv.policies.base import ScoreContext
from vlm_kv.policies.retention import RetentionScorer
from vlm_kv.storage.store import VarlenKVStore
from vlm_kv.testing import tiny_gates, tiny_model

N = 12


def _scores(scorer: RetentionScorer, log_beta: torch.Tensor, valid_from: int | None = None) -> torch.Tensor:
    store = VarlenKVStore(1, 1, 4, torch.float32, torch.device("cpu"), state_names=("log_beta",))
    store.append(torch.randn(1, 1, N, 4), torch.randn(1, 1, N, 4), torch.arange(N),
                 torch.zeros(1, N, dtype=torch.uint8), torch.ones(1, N, dtype=torch.bool))
    store.set_tail_state("log_beta", log_beta.view(1, 1, N))
    view = store.padded_view(states=scorer.state_names)
    if valid_from is not None:  # an empty slot, as batch padding or a ragged row leaves
        view.valid[..., valid_from:] = False
        view.state["log_beta"][..., valid_from:] = 0.0  # the best retention there is: must not leak
    ctx = ScoreContext(0, 1, view, torch.zeros(1, 1, 1, 4), torch.tensor([N]), 1.0, N, torch.tensor([4]),
                       torch.Generator().manual_seed(0))
    return scorer.score(ctx)[0, 0]


def _window_max(raw: torch.Tensor, half: int, valid: int) -> torch.Tensor:
    return torch.stack([raw[max(0, i - half): min(valid, i + half + 1)].max() for i in range(valid)])


def test_span_one_is_the_reference_score_and_per_entry():
    log_beta = -torch.rand(N)
    scorer = RetentionScorer()
    assert scorer.score_is_per_entry
    torch.testing.assert_close(_scores(scorer, log_beta), (N - torch.arange(N)).float() * log_beta)


def test_a_span_lends_each_entry_the_best_score_of_its_neighbours():
    log_beta = torch.full((N,), -1.0)
    log_beta[6] = -0.001  # one entry the gates want to keep
    raw = _scores(RetentionScorer(), log_beta)
    pooled = _scores(RetentionScorer(span=3), log_beta)
    assert not RetentionScorer(span=3).score_is_per_entry
    assert torch.equal(pooled[5:8], raw[6].expand(3))            # its two neighbours score as it does
    assert torch.equal(pooled, _window_max(raw, 1, N))


def test_empty_slots_lend_no_score():
    log_beta = torch.full((N,), -1.0)
    pooled = _scores(RetentionScorer(span=5), log_beta, valid_from=9)
    raw = _scores(RetentionScorer(), log_beta, valid_from=9)
    assert torch.equal(pooled[:9], _window_max(raw, 2, 9))  # the 0.0 of the empty slots never shows


@pytest.mark.parametrize("span", [0, 2, -3, 1.0, True])
def test_a_span_that_is_not_an_odd_positive_int_is_refused(span):
    with pytest.raises(ValueError, match="span must be an odd int"):
        RetentionScorer(span=span)


def test_a_pooled_global_cache_evicts_at_the_end_of_the_prompt_and_holds_its_budget():
    """Dropping entries layer by layer would change their neighbours' pooled scores: the global step
    then runs once, at the end of the forward (the prompt held whole until then)."""
    model = tiny_model("llama", num_layers=4)
    gates = tiny_gates(model, kind="dbtrimkv")
    ids = torch.randint(16, 200, (1, 120), generator=torch.Generator().manual_seed(0))
    caches = {}
    for span in (1, 5):
        cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.2, gates=gates,
                                  options=CacheOptions(scorer_kwargs={"span": span}))
        model(input_ids=ids, cache=cache)
        caches[span] = cache
        assert cache.kv_bytes()["total"] <= cache.budget_bytes()
    assert caches[1].peak_kv_bytes < caches[1].full_kv_bytes()
    assert caches[5].peak_kv_bytes == caches[5].full_kv_bytes()
    held = [layer.held_positions()[0] for layer in caches[5].layers]
    assert sum(int((p >= 0).sum()) for p in held) > 0


def test_a_pooled_cache_routes_tiers_and_generates():
    model = tiny_model("qwen2", num_layers=3)
    gates = tiny_gates(model, kind="dbtrimkv")
    ids = torch.randint(16, 200, (1, 90), generator=torch.Generator().manual_seed(1))
    cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.2, gates=gates, tiers="int2",
                              options=CacheOptions(scorer_kwargs={"span": 3}))
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20,
                         do_sample=False, cache=cache)
    assert out.shape[1] == ids.shape[1] + 20
    assert cache.max_kv_bytes <= cache.budget_bytes()


def test_shared_heads_score_a_position_by_its_best_head_matched_by_position():
    from vlm_kv.policies.retention import best_over_heads
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 3, 5, generator=g)
    # ragged rows: the heads hold different positions at the same slots, some slots empty
    positions = torch.tensor([[[0, 2, 4, 6, 8], [2, 3, 4, 5, 9], [0, 1, 2, 3, 4]],
                              [[1, 2, 3, 0, 0], [0, 1, 3, 7, 0], [3, 7, 8, 9, 10]]])
    valid = torch.ones(2, 3, 5, dtype=torch.bool)
    valid[1, 0, 3:] = False
    valid[1, 1, 4] = False
    scores[1, 0, 3:] = 100.0  # empty slots: their score must reach no other head
    out = best_over_heads(scores, positions, valid)
    for b in range(2):
        for h in range(3):
            for i in range(5):
                if not valid[b, h, i]:
                    assert out[b, h, i] == scores[b, h, i]
                    continue
                same = (positions[b] == positions[b, h, i]) & valid[b]
                assert out[b, h, i] == scores[b][same].max()
    assert not RetentionScorer(share_heads=True).score_is_per_entry
    with pytest.raises(ValueError, match="share_heads must be a bool"):
        RetentionScorer(share_heads=1)


def test_shared_heads_keep_whole_positions_in_a_layer_and_hold_the_budget():
    """Untiered global eviction with shared heads: each layer's heads hold the same positions (a tie at
    the budget's edge may split one position), where unshared gates keep each head its own."""
    model = tiny_model("llama", num_layers=3)
    gates = tiny_gates(model, kind="dbtrimkv")
    ids = torch.randint(16, 200, (1, 100), generator=torch.Generator().manual_seed(0))
    split = {}
    for share in (False, True):
        cache = vlm_kv.make_cache(model, policy="dbtrimkv", budget=0.25, gates=gates,
                                  options=CacheOptions(scorer_kwargs={"share_heads": share}))
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                             min_new_tokens=12, do_sample=False, cache=cache)
        assert out.shape[1] == 112
        assert cache.max_kv_bytes <= cache.budget_bytes()
        split[share] = 0
        for layer in cache.layers:
            held = layer.held_positions()[0][0]  # [H, L], -1 where empty
            sets = [set(p[p >= 0].tolist()) for p in held]
            union = set().union(*sets)
            split[share] += sum(1 for p in union if not all(p in s for s in sets))
    assert split[True] <= 1
    assert split[False] > 10
