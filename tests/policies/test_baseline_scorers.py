"""Each baseline keeps what its definition says on a hand-built attention pattern.

Keys are multiples of one direction, so a query along that direction attends to entry i in
proportion to exp(key_i): the test decides which entries draw attention.
"""
import torch

from vlm_kv.storage.allocation import HeadAdaptive, Uniform
from vlm_kv.policies import H2O, KNorm, RandomScorer, SnapKV, StreamingLLM, TOVA
from vlm_kv.policies.base import ScoreContext, protect
from vlm_kv.storage.store import VarlenKVStore

N, D = 40, 4


def _store(strength: torch.Tensor, heads: int = 1) -> VarlenKVStore:
    store = VarlenKVStore(1, heads, D, torch.float32, torch.device("cpu"), state_names=("attn_sum",))
    keys = torch.zeros(1, heads, N, D)
    keys[..., 0] = strength
    store.append(keys, torch.randn(1, heads, N, D), torch.arange(N), torch.zeros(1, N, dtype=torch.uint8),
                 torch.ones(1, N, dtype=torch.bool))
    return store


def _query(heads: int = 1, n: int = 1) -> torch.Tensor:
    q = torch.zeros(1, heads, n, D)
    q[..., 0] = 1.0
    return q


def _keep(scorer, store, cap, allocation=None, queries=None):
    view = store.padded_view(states=scorer.state_names)
    heads = store.num_kv_heads
    if queries is None:
        queries = _query(heads, max(1, scorer.query_window))
    qpos = torch.arange(N - queries.shape[2], N)
    ctx = ScoreContext(0, 1, view, queries, qpos, 1.0, N, torch.tensor([cap]), torch.Generator().manual_seed(0))
    scores = scorer.score(ctx)
    window = torch.tensor([scorer.protected_window(cap)])
    scores = protect(scores, view, scorer.sinks, window, torch.tensor([0]), N)
    keep = (allocation or Uniform()).keep_layer(scores, torch.tensor([cap]))
    return [set(torch.nonzero(keep[0, h]).flatten().tolist()) for h in range(heads)]


def test_streaming_llm_keeps_sinks_and_recent():
    kept = _keep(StreamingLLM(num_sinks=4), _store(torch.zeros(N)), cap=10)[0]
    assert kept == {0, 1, 2, 3} | set(range(N - 6, N))


def test_snapkv_keeps_attended_entries_plus_window():
    strength = torch.zeros(N)
    strength[[5, 17]] = 8.0
    kept = _keep(SnapKV(window=8, kernel=1), _store(strength), cap=10)[0]
    assert kept == {5, 17} | set(range(N - 8, N))


def test_snapkv_pooling_keeps_neighbours_of_a_hot_entry():
    strength = torch.zeros(N)
    strength[10] = 8.0
    kept = _keep(SnapKV(window=8, kernel=5), _store(strength), cap=13)[0]
    assert {8, 9, 10, 11, 12} <= kept


def test_h2o_accumulates_attention_over_all_queries():
    strength = torch.zeros(N)
    strength[[2, 3]] = 6.0
    scorer = H2O(recent_ratio=0.5)
    store = _store(strength)
    view = store.padded_view()
    scorer.observe(store, _query(1, 4), view, torch.arange(N - 4, N), 1.0)
    kept = _keep(scorer, store, cap=8)[0]
    assert {2, 3} <= kept and set(range(N - 4, N)) <= kept and len(kept) == 8


def test_tova_uses_the_current_query_and_averages_over_heads():
    strength = torch.zeros(2, N)
    strength[0, 7] = 9.0    # head 0 loves entry 7
    strength[1, 7] = 9.0
    strength[1, 30] = 9.5   # head 1 loves entry 30 a bit more
    store = VarlenKVStore(1, 2, D, torch.float32, torch.device("cpu"))
    keys = torch.zeros(1, 2, N, D)
    keys[..., 0] = strength
    store.append(keys, torch.randn(1, 2, N, D), torch.arange(N), torch.zeros(1, N, dtype=torch.uint8),
                 torch.ones(1, N, dtype=torch.bool))
    kept = _keep(TOVA(), store, cap=1)
    assert kept[0] == kept[1] == {7}  # shared by heads: 7 is best on average


def test_knorm_keeps_smallest_key_norms():
    strength = torch.arange(N, dtype=torch.float32) + 1
    kept = _keep(KNorm(), _store(strength), cap=5)[0]
    assert kept == {0, 1, 2, 3, 4}


def test_random_keeps_exactly_cap_and_is_seeded():
    a = _keep(RandomScorer(), _store(torch.zeros(N)), cap=7)[0]
    b = _keep(RandomScorer(), _store(torch.zeros(N)), cap=7)[0]
    assert len(a) == 7 and a == b


def test_adakv_moves_budget_to_the_head_that_needs_it():
    strength = torch.zeros(2, N)
    strength[0, 3] = 12.0                      # head 0: one entry matters
    strength[1] = torch.linspace(0.0, 1.0, N)  # head 1: diffuse
    store = VarlenKVStore(1, 2, D, torch.float32, torch.device("cpu"))
    keys = torch.zeros(1, 2, N, D)
    keys[..., 0] = strength
    store.append(keys, torch.randn(1, 2, N, D), torch.arange(N), torch.zeros(1, N, dtype=torch.uint8),
                 torch.ones(1, N, dtype=torch.bool))
    kept = _keep(SnapKV(window=2, kernel=1), store, cap=12, allocation=HeadAdaptive(floor_ratio=0.2))
    assert 3 in kept[0]
    assert len(kept[1]) > len(kept[0]) and len(kept[0]) + len(kept[1]) == 24
