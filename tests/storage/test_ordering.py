import pytest
import torch

from vlm_kv.storage.ordering import descending_order, order_keys

SPECIALS = [float("inf"), float("-inf"), 0.0, -0.0, 0.0, -0.0, float("-inf"), 1e-30, -1e-30]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1000,), (4, 777), (3, 5, 300)])
def test_same_permutation_as_a_stable_descending_argsort(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 3
    x = torch.where(torch.rand(shape, generator=g) < 0.3, x.round(), x).to(dtype)  # many ties
    x.view(-1)[: len(SPECIALS)] = torch.tensor(SPECIALS).to(dtype)
    for dim in range(-len(shape), 0):
        assert torch.equal(descending_order(x, dim), torch.argsort(x, dim=dim, descending=True, stable=True))


def test_keys_order_as_the_floats_do():
    x = torch.tensor([float("-inf"), -3.5, -1.0, -1e-30, -0.0, 0.0, 1e-30, 2.0, float("inf")])
    keys = order_keys(x)
    differ = x[1:] != x[:-1]
    assert (keys[1:][differ] < keys[:-1][differ]).all()  # a larger float gets a smaller key
    assert keys[4] == keys[5]  # -0.0 and 0.0 tie, as they compare equal


def test_nan_and_integer_scores_fall_back_to_argsort():
    x = torch.tensor([1.0, float("nan"), 3.0, 1.0])
    assert torch.equal(descending_order(x), torch.argsort(x, descending=True, stable=True))
    ints = torch.tensor([3, 1, 3, 2])
    assert torch.equal(descending_order(ints), torch.argsort(ints, descending=True, stable=True))
