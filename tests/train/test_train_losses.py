import torch

from vlm_kv.train.losses import capacity_loss, distill_losses, expected_live


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


def test_expected_live_matches_double_loop_and_chunks():
    lb = _random_log_betas(1)[0]
    want = _brute_live(lb)
    for chunk in (1, 3, 64):
        torch.testing.assert_close(expected_live(lb, chunk=chunk).double(), want, rtol=1e-5, atol=1e-5)


def test_capacity_per_head_matches_brute_force():
    lbs = _random_log_betas()
    m = 2
    n_layers, (b, h, t) = len(lbs), lbs[0].shape
    total, count = 0.0, 0
    for lb in lbs:
        s = _brute_live(lb)
        for bi in range(b):
            for hi in range(h):
                for tt in range(t):
                    n = tt + 1
                    total += max(0.0, (s[bi, hi, tt].item() - m) / max(n - m, 1))
                    count += 1
    got, live = capacity_loss(lbs, m, global_budget=False, chunk=4)
    assert abs(got.item() - total / count) < 1e-5
    assert got.item() > 0
    assert live.shape == (n_layers, h)


def test_capacity_global_matches_brute_force():
    lbs = _random_log_betas(seed=1)
    m = 3
    n_layers, (b, h, t) = len(lbs), lbs[0].shape
    s = [_brute_live(lb) for lb in lbs]
    total = 0.0
    for bi in range(b):
        for tt in range(t):
            n = tt + 1
            live = sum(s[li][bi, hi, tt].item() for li in range(n_layers) for hi in range(h))
            total += max(0.0, (live - m * n_layers * h) / (n_layers * h * max(n - m, 1)))
    got, _ = capacity_loss(lbs, m, global_budget=True, chunk=5)
    assert abs(got.item() - total / (b * t)) < 1e-5


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
