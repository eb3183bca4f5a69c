"""Losses for gate training: distillation base loss and the capacity (memory budget) loss.

base = (KL(p_full || q_gated) + CE) / 2, both means over the labelled next-token positions:
the teacher p_full is the frozen model without gates, the student q_gated the same model
under soft retention; CE is the student's next-token cross-entropy on the labels.

Capacity: for one (layer, head), S_t = sum_{i <= t} beta_i ** (t - i) is the expected number
of live cache entries after token t. With n_t = t + 1 tokens seen (so S_t <= n_t):

    per head (TrimKV):  mean_t max(0, (S_t - M) / max(n_t - M, 1))
    global  (DBTrimKV): mean_t max(0, (sum_{l,h} S_t - M*L*H) / (L*H * max(n_t - M, 1)))

Each term is in [0, 1]: 0 within budget, 1 when nothing is forgotten at all. Means are over
(batch, t) -- and over layers and heads in the per-head case -- for the valid positions.
M may differ per sequence (multi-budget training draws it as a fraction of the sequence).

S_t is computed in O(T) per head by ``expected_live`` (a scan over a grid of decay rates,
see there) rather than the O(T^2) double sum ``expected_live_pairwise``, kept as reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def distill_losses(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(kl, ce) averaged over labelled positions.

    logits [B, T, V] predict the token after each position; labels [B, T] are the *next*
    tokens (already shifted), -100 where not labelled.
    """
    mask = labels != -100
    n = mask.sum().clamp(min=1)
    s = student_logits[mask].float()
    t = teacher_logits[mask].float()
    log_q = F.log_softmax(s, dim=-1)
    log_p = F.log_softmax(t, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).sum() / n
    ce = F.cross_entropy(s, labels[mask], reduction="sum") / n
    return kl, ce


def _live_chunk(log_beta: torch.Tensor, start: torch.Tensor, stop: int) -> torch.Tensor:
    """S_t for t in [start, stop): log_beta [B, H, T] -> [B, H, stop - start]."""
    t_len = log_beta.shape[-1]
    t = torch.arange(int(start), stop, device=log_beta.device)
    i = torch.arange(t_len, device=log_beta.device)
    age = (t[:, None] - i[None, :]).float()  # [c, T]
    terms = torch.exp(age.clamp(min=0) * log_beta.float()[:, :, None, :])  # [B, H, c, T]
    return terms.masked_fill((age < 0), 0.0).sum(-1)


def expected_live_pairwise(log_beta: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """S_t = sum_{i<=t} beta_i^(t-i) by the double sum: O(T^2) work (the exact reference).

    Computed in chunks of ``chunk`` query steps, each recomputed in backward, so memory is
    O(B * H * chunk * T) rather than O(T^2).
    """
    t_len = log_beta.shape[-1]
    outs = []
    for start in range(0, t_len, chunk):
        stop = min(start + chunk, t_len)
        s = torch.tensor(start)
        if torch.is_grad_enabled() and log_beta.requires_grad:
            outs.append(checkpoint(_live_chunk, log_beta, s, stop, use_reentrant=False))
        else:
            outs.append(_live_chunk(log_beta, s, stop))
    return torch.cat(outs, dim=-1)


# Decay rates x = -log beta are clamped to [X_MIN, X_MAX] before the scan: below X_MIN an
# entry loses at most T * X_MIN of its weight over T steps (2e-6 at T = 2048), above X_MAX it
# is gone (< 2e-9) one step after it was written, so neither clamp moves S_t measurably.
X_MIN, X_MAX = 1e-9, 20.0


def expected_live(log_beta: torch.Tensor, grid_step: float = 0.25) -> torch.Tensor:
    """S_t = sum_{i<=t} beta_i^(t-i) for every t in O(T * K): [B, H, T] log beta -> [B, H, T] float32.

    Why not a plain recurrence: every entry decays at its *own* rate, so S_t is not
    beta * S_{t-1} + 1 for any single beta, and the exact double sum costs O(T^2). But if all
    rates came from a fixed set r_1..r_K, S_t would split into K decayed prefix sums, each a
    linear recurrence D_k(t) = r_k D_k(t-1) + w_k(t). So each entry's rate x_i = -log beta_i
    is placed on a grid that is uniform in log x (step ``grid_step``) and its unit weight is
    split between the two neighbouring grid rates, linearly in log x. The K = ~24 / grid_step
    recurrences then run side by side over t: O(T * K) work, K independent of T.

    Error: per entry and step, |beta^n - interpolation| <= grid_step^2 / 8 * max_y |y - y^2| e^-y
    (y = n x) < 0.04 * grid_step^2, i.e. < 2.5e-3 of one entry at the default 0.25 and
    < 1e-4 at 0.05; tests compare against ``expected_live_pairwise``. Gradients reach log beta
    through the interpolation weights (the secant slope between grid rates).
    """
    if grid_step <= 0:
        raise ValueError(f"grid_step must be > 0, got {grid_step}")
    b, h, t_len = log_beta.shape
    dev = log_beta.device
    log_x = torch.log((-log_beta.double()).clamp(min=X_MIN, max=X_MAX))  # [B, H, T]
    lo, hi = math.log(X_MIN), math.log(X_MAX)
    k = int(math.ceil((hi - lo) / grid_step)) + 1
    pos = (log_x - lo) / grid_step
    cell = pos.detach().floor().clamp(max=k - 2)
    frac = pos - cell  # in [0, 1]; carries the gradient
    cell = cell.long()
    weights = torch.zeros(b * h, t_len, k, dtype=torch.float64, device=dev)
    flat_cell = cell.reshape(b * h, t_len, 1)
    flat_frac = frac.reshape(b * h, t_len, 1)
    weights = weights.scatter_add(-1, flat_cell, 1.0 - flat_frac).scatter_add(-1, flat_cell + 1, flat_frac)
    rates = torch.exp(-torch.exp(lo + grid_step * torch.arange(k, dtype=torch.float64, device=dev)))  # [K]
    return _DecayedPrefixSum.apply(weights, rates).reshape(b, h, t_len).float()


class _DecayedPrefixSum(torch.autograd.Function):
    """out[n, t] = sum_k D[n, t, k], D[n, t, k] = rates[k] * D[n, t-1, k] + weights[n, t, k].

    Backward is the same scan run backwards (dL/dw[n, i, k] = sum_{t>=i} g[n, t] rates[k]^(t-i)),
    so no autograd graph of T steps is kept."""

    @staticmethod
    def forward(ctx, weights: torch.Tensor, rates: torch.Tensor) -> torch.Tensor:
        n, t_len, k = weights.shape
        live = weights.new_zeros(n, k)
        out = weights.new_empty(n, t_len)
        for t, w_t in enumerate(weights.unbind(1)):
            live = torch.addcmul(w_t, live, rates)
            out[:, t] = live.sum(-1)
        ctx.save_for_backward(rates)
        ctx.shape = weights.shape
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (rates,) = ctx.saved_tensors
        n, t_len, k = ctx.shape
        grad_w = grad_out.new_empty(n, t_len, k)
        acc = grad_out.new_zeros(n, k)
        for t in range(t_len - 1, -1, -1):
            acc = torch.addcmul(grad_out[:, t : t + 1].expand(n, k), acc, rates)
            grad_w[:, t] = acc
        return grad_w, None


def capacity_loss(log_betas: list[torch.Tensor], budget: float | torch.Tensor, global_budget: bool,
                  valid: torch.Tensor | None = None, exact: bool = False, grid_step: float = 0.25,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_cap, live) for the per-layer log betas [B, H, T] of one forward.

    budget: M, tokens per KV head: one number, or a [B] tensor (one M per sequence, e.g. a
    sampled fraction of each sequence's length; see ``budget_from_fraction``).
    global_budget: compare the sum over all layers and heads with M * L * H (DBTrimKV)
    instead of each head with M (TrimKV). valid: [B, T] bool, the positions that count
    (padding excluded). exact: S_t by the O(T^2) double sum instead of the O(T) scan.
    live: [L, H] mean S_T / T at the last valid position (the expected fraction of the cache
    alive at the end; detached, for logging).
    """
    n_layers = len(log_betas)
    b, n_heads, t_len = log_betas[0].shape
    stacked = torch.cat(log_betas, dim=0)  # [L * B, H, T]: one scan for every layer
    if exact:
        s = expected_live_pairwise(stacked)
    else:
        s = expected_live(stacked, grid_step)
    live = s.reshape(n_layers, b, n_heads, t_len)
    dev = live.device
    m = torch.as_tensor(budget, dtype=torch.float32, device=dev).reshape(-1)
    if m.numel() == 1:
        m = m.expand(b)
    if m.numel() != b:
        raise ValueError(f"budget has {m.numel()} values for a batch of {b}")
    n_t = torch.arange(1, t_len + 1, device=dev, dtype=torch.float32)
    denom = (n_t[None, :] - m[:, None]).clamp(min=1.0)  # [B, T]
    if valid is None:
        valid = torch.ones(b, t_len, dtype=torch.bool, device=dev)
    valid = valid.to(dev)
    w = valid.float()
    if global_budget:
        total = live.sum(dim=(0, 2))  # [B, T]
        over = F.relu((total - m[:, None] * n_layers * n_heads) / (n_layers * n_heads * denom))
        loss = (over * w).sum() / w.sum().clamp(min=1)
    else:
        over = F.relu((live - m[None, :, None, None]) / denom[None, :, None, :])  # [L, B, H, T]
        loss = (over * w[None, :, None, :]).sum() / (w.sum().clamp(min=1) * n_layers * n_heads)
    with torch.no_grad():
        last = valid.long().sum(-1).clamp(min=1) - 1  # [B]
        end = live.detach().gather(-1, last.view(1, b, 1, 1).expand(n_layers, b, n_heads, 1)).squeeze(-1)
        live_frac = (end / (last + 1).float().view(1, b, 1)).mean(1)  # [L, H]
    return loss, live_frac


def budget_from_fraction(fraction: float, valid: torch.Tensor) -> torch.Tensor:
    """M per sequence for a budget given as a fraction of each sequence's valid length: [B]."""
    if not 0 < fraction <= 1:
        raise ValueError(f"budget fraction must be in (0, 1], got {fraction}")
    return fraction * valid.sum(-1).float()
