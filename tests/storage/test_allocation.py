import torch

from vlm_kv.storage.allocation import GlobalTopK, HeadAdaptive, Pyramid, Uniform, top_k_mask


def test_top_k_mask_exact_counts_and_never_empty_slots():
    s = torch.tensor([[3.0, 1.0, float("-inf"), 2.0, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    m = top_k_mask(s, torch.tensor([3, 2]))
    assert m.sum(1).tolist() == [3, 2]
    assert m[0].tolist() == [True, False, False, True, True]
    m = top_k_mask(s, torch.tensor([5, 1]))
    assert not bool(m[0, 2])  # -inf never kept


def test_uniform_keeps_cap_per_head():
    s = torch.randn(2, 3, 20)
    keep = Uniform().keep_layer(s, torch.tensor([5, 7]))
    assert keep.sum(-1).tolist() == [[5, 5, 5], [7, 7, 7]]


def test_pyramid_capacities_decrease_with_depth_and_average_to_cap():
    caps = [int(Pyramid().layer_capacity(l, 10, torch.tensor([100]), window=8)) for l in range(10)]
    assert caps == sorted(caps, reverse=True) and caps[0] > 100 > caps[-1]
    assert abs(sum(caps) / 10 - 100) <= 1
    assert caps[-1] >= 8


def test_adaptive_gives_concentrated_heads_less_and_respects_floor():
    s = torch.zeros(1, 2, 50)
    s[0, 0, :3] = 10.0                          # head 0: three important entries
    s[0, 1] = torch.linspace(5, 4, 50)          # head 1: everything similar and high
    keep = HeadAdaptive(floor_ratio=0.2).keep_layer(s, torch.tensor([10]))
    per_head = keep.sum(-1)[0].tolist()
    assert per_head == [3, 17]  # 2 + 2 by the floor, then the 16 best left: head 0's third, 15 of head 1
    assert bool(keep[0, 0, :3].all())
    # the floor holds even for a head whose scores are all below the other head's
    s[0, 0] = -1.0
    keep = HeadAdaptive(floor_ratio=0.2).keep_layer(s, torch.tensor([10]))
    assert keep.sum(-1)[0].tolist() == [2, 18]


def test_global_top_k_over_layers_and_min_per_head():
    a = torch.full((1, 2, 10), -5.0)
    b = torch.full((1, 2, 10), -1.0)
    keeps = GlobalTopK().keep_all([a, b], torch.tensor([5]))
    assert int(keeps[0].sum()) == 0 and int(keeps[1].sum()) == 20  # 2 layers x 2 heads x 5
    keeps = GlobalTopK(min_per_head=2).keep_all([a, b], torch.tensor([5]))
    assert keeps[0].sum(-1).tolist() == [[2, 2]]
    assert int(keeps[0].sum() + keeps[1].sum()) == 20
    # the global top-k is exactly the k best scores overall
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(1, 3, 7, generator=g), torch.randn(1, 3, 11, generator=g)]
    keeps = GlobalTopK().keep_all(layers, torch.tensor([4]))
    flat = torch.cat([l.flatten() for l in layers])
    kept = torch.cat([l[k] for l, k in zip(layers, keeps)])
    assert torch.equal(kept.sort().values, flat.topk(24).values.sort().values)
