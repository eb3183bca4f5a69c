"""Ranking and per-layer layout of a routing event's candidates (``vlm_kv.tiers.groups``)."""
import torch

from vlm_kv.tiers.groups import Ranking, per_layer
from vlm_kv.tiers.windows import EVICT


def test_one_group_ranks_as_the_general_two_sort_path():
    gen = torch.Generator().manual_seed(0)
    score = torch.randint(0, 5, (200,), generator=gen).double()  # many ties: stability matters
    zeros = torch.zeros(200, dtype=torch.long)
    one = Ranking.by_score(zeros, score, 1)
    general = Ranking.by_score(zeros, score, 2)  # a second, empty group takes the general path
    assert torch.equal(one.order, general.order) and torch.equal(one.rank, general.rank)
    assert bool((score[one.order][1:] <= score[one.order][:-1]).all())


def test_per_layer_lays_out_candidates_given_layer_after_layer_or_shuffled():
    gen = torch.Generator().manual_seed(1)
    shapes = [(1, 2, 5), (1, 2, 3), (1, 2, 4)]
    layer = torch.cat([torch.full((n,), li) for li, n in enumerate([6, 0, 5])])
    index = torch.cat([torch.randperm(10, generator=gen)[:6], torch.randperm(8, generator=gen)[:5]])
    decision = torch.randint(0, 3, (11,), generator=gen)
    in_order = per_layer(decision, layer, index, shapes)
    perm = torch.randperm(11, generator=gen)
    shuffled = per_layer(decision[perm], layer[perm], index[perm], shapes)
    for a, b, shape in zip(in_order, shuffled, shapes):
        assert a.shape == shape and torch.equal(a, b)
    assert bool((in_order[1] == EVICT).all())  # no candidate in layer 1
    assert torch.equal(in_order[0].view(-1)[index[:6]], decision[:6])
