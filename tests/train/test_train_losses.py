
import pytest
import torch

from vlm_kv.train.losses import (budget_from_fraction, capacity_loss, distill_losses, expected_live,
                                 expected_live_pairwise)


def _brute_live(lb: torch.Tensor) -> torch.Tensor:
    b, h, t = lb.shape
    out = torch.zeros(b, h, t, dtype=torch.float64)
    beta = lb.double().exp()
    for bi in range(b):
        for hi in range(h):
            for tt in range(t):
                out[bi, hi, tt] = sum(beta[bi, hi, i] ** (tt - i) for i in range(tt + 1))
    return out


def _random_log_betas(n_layers=3, b=2, h=2, t=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    # betas spread over (0.3, 1): some heads keep, some forget
    return [torch.log(0.3 + 0.7 * torch.rand(b, h, t, generator=g)) for _ in range(n_layers)]


def _wide_log_betas(b=2, h=3, t=300, seed=0):
    """Rates over many decades, as trained gates produce: beta from ~1 - 1e-8 to ~1e-6."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.empty(b, h, t).uniform_(-14, 18, generator=g)
    return torch.nn.functional.logsigmoid(logits)


def test_pairwise_live_matches_double_loop_and_chunks():
    lb = _random_log_betas(1)[0]
    want = _brute_live(lb)
    for chunk in (1, 3, 64):
        torch.testing.assert_close(expected_live_pairwise(lb, chunk=chunk).double(), want, rtol=1e-5, atol=1e-5)


def test_scan_live_matches_double_sum_within_its_error_bound():
    lb = _wide_log_betas()
    want = expected_live_pairwise(lb.double().float()).double()
    t = lb.shape[-1]
    for step in (0.25, 0.05):
        got = expected_live(lb, grid_step=step).double()
        # per entry and step the interpolation is off by < 0.04 * step^2 (see expected_live)
        bound = 0.04 * step ** 2 * torch.arange(1, t + 1, dtype=torch.float64) + 1e-4
        err = (got - want).abs()
        assert bool((err <= bound).all()), (step, (err - bound).max().item())
    # and the fine grid is tight in relative terms
    torch.testing.assert_close(expected_live(lb, grid_step=0.02).double(), want, rtol=2e-4, atol=1e-3)
    torch.testing.assert_close(expected_live(_random_log_betas(1)[0], grid_step=0.02).double(),
                               _brute_live(_random_log_betas(1)[0]), rtol=2e-4, atol=1e-4)


def test_scan_gradient_matches_pairwise_gradient():
    lb = _wide_log_betas(b=1, h=2, t=120, seed=3)
    weights = torch.rand(lb.shape, generator=torch.Generator().manual_seed(1))
    grads = []
    for fn in (lambda x: expected_live(x, grid_step=0.02), expected_live_pairwise):
        x = lb.clone().requires_grad_()
        (fn(x) * weights).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0.05, atol=0.05 * grads[1].abs().max().item())


def _brute_per_head(lbs, m):
    n_layers, (b, h, t) = len(lbs), lbs[0].shape
    ms = [m] * b if not torch.is_tensor(m) else m.tolist()
    total, count = 0.0, 0
    for lb in lbs:
        s = _brute_live(lb)
        for bi in range(b):
            for hi in range(h):
                for tt in range(t):
                    n = tt + 1
                    total += max(0.0, (s[bi, hi, tt].item() - ms[bi]) / max(n - ms[bi], 1))
                    count += 1
    return total / count


def _brute_global(lbs, m):
    n_layers, (b, h, t) = len(lbs), lbs[0].shape
    ms = [m] * b if not torch.is_tensor(m) else m.tolist()
    s = [_brute_live(lb) for lb in lbs]
    total = 0.0
    for bi in range(b):
        for tt in range(t):
            n = tt + 1
            live = sum(s[li][bi, hi, tt].item() for li in range(n_layers) for hi in range(h))
            total += max(0.0, (live - ms[bi] * n_layers * h) / (n_layers * h * max(n - ms[bi], 1)))
    return total / (b * t)


@pytest.mark.parametrize("exact", [True, False])
def test_capacity_per_head_matches_brute_force(exact):
    lbs = _random_log_betas()
    got, live = capacity_loss(lbs, 2, global_budget=False, exact=exact, grid_step=0.02)
    want = _brute_per_head(lbs, 2)
    assert want > 0 and abs(got.item() - want) < (1e-5 if exact else 2e-4)
    assert live.shape == (3, 2)


@pytest.mark.parametrize("exact", [True, False])
def test_capacity_global_matches_brute_force(exact):
    lbs = _random_log_betas(seed=1)
    got, _ = capacity_loss(lbs, 3, global_budget=True, exact=exact, grid_step=0.02)
    want = _brute_global(lbs, 3)
    assert want > 0 and abs(got.item() - want) < (1e-5 if exact else 2e-4)


def test_capacity_target_follows_per_sequence_budget():
    """M is a sampled fraction of each sequence: the loss uses each row's own M."""
    lbs = _random_log_betas(seed=2)
    valid = torch.ones(2, 11, dtype=torch.bool)
    for fraction in (0.1, 0.3, 0.6):
        m = budget_from_fraction(fraction, valid)
        assert torch.allclose(m, torch.full((2,), fraction * 11))
        for global_budget, brute in ((True, _brute_global), (False, _brute_per_head)):
            got, _ = capacity_loss(lbs, m, global_budget=global_budget, exact=True)
            assert abs(got.item() - brute(lbs, m)) < 1e-5
    # a larger budget never costs more, and rows with different budgets are scored apart
    losses = [capacity_loss(lbs, budget_from_fraction(f, valid), True, exact=True)[0].item() for f in (0.1, 0.3, 0.6)]
    assert losses[0] > losses[1] > losses[2]
    mixed = torch.tensor([0.1 * 11, 0.6 * 11])
    got, _ = capacity_loss(lbs, mixed, True, exact=True)
    assert abs(got.item() - _brute_global(lbs, mixed)) < 1e-5
    with pytest.raises(ValueError, match="budget fraction"):
        budget_from_fraction(0.0, valid)
    with pytest.raises(ValueError, match="batch of 2"):
        capacity_loss(lbs, torch.ones(3), True)


def test_capacity_zero_within_budget_and_grad_flows():
    lbs = [torch.full((1, 2, 8), -5.0, requires_grad=True)]  # beta ~ 0.007: ~1 live entry
    loss, _ = capacity_loss(lbs, budget=4, global_budget=True)
    assert loss.item() == 0.0
    keep = [torch.full((1, 2, 8), -1e-4, requires_grad=True)]  # beta ~ 1: everything stays
    loss, live = capacity_loss(keep, budget=2, global_budget=False)
    assert loss.item() > 0.5 and live.min().item() > 0.99
    loss.backward()
    assert keep[0].grad is not None and keep[0].grad.abs().sum() > 0


def test_kl_zero_when_student_equals_teacher():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 17, generator=g)
    labels = torch.randint(0, 17, (2, 6), generator=g)
    labels[0, :2] = -100
    kl, ce = distill_losses(logits, logits.clone(), labels)
    assert abs(kl.item()) < 1e-6
    want = torch.nn.functional.cross_entropy(logits[labels != -100], labels[labels != -100])
    assert abs(ce.item() - want.item()) < 1e-5
    kl2, _ = distill_losses(logits, torch.randn(2, 6, 17, generator=g), labels)
    assert kl2.item() > 0
