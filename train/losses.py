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
"""

from __future__ import annotations

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


def expected_live(log_beta: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """S_t = sum_{i<=t} beta_i^(t-i) for every t: [B, H, T] log beta -> [B, H, T] float32.

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


def capacity_loss(log_betas: list[torch.Tensor], budget: int, global_budget: bool,
                  valid: torch.Tensor | None = None, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_cap, live) for the per-layer log betas [B, H, T] of one forward.

    budget: M, tokens per KV head. global_budget: compare the sum over all layers and heads
    with M * L * H (DBTrimKV) instead of each head with M (TrimKV). valid: [B, T] bool, the
    positions that count (padding excluded). live: [L, H] mean S_T / T at the last valid
    position (the expected fraction of the cache alive at the end; detached, for logging).
    """
    live = torch.stack([expected_live(lb, chunk) for lb in log_betas])  # [L, B, H, T]
    n_layers, b, n_heads, t_len = live.shape
    n_t = torch.arange(1, t_len + 1, device=live.device, dtype=torch.float32)
    denom = (n_t - budget).clamp(min=1.0)  # [T]
    if valid is None:
        valid = torch.ones(b, t_len, dtype=torch.bool, device=live.device)
    valid = valid.to(live.device)
    w = valid.float()
    if global_budget:
        total = live.sum(dim=(0, 2))  # [B, T]
        over = F.relu((total - budget * n_layers * n_heads) / (n_layers * n_heads * denom))
        loss = (over * w).sum() / w.sum().clamp(min=1)
    else:
        over = F.relu((live - budget) / denom)  # [L, B, H, T]
        loss = (over * w[None, :, None, :]).sum() / (w.sum().clamp(min=1) * n_layers * n_heads)
    with torch.no_grad():
        last = valid.long().sum(-1).clamp(min=1) - 1  # [B]
        end = live.detach().gather(-1, last.view(1, b, 1, 1).expand(n_layers, b, n_heads, 1)).squeeze(-1)
        live_frac = (end / (last + 1).float().view(1, b, 1)).mean(1)  # [L, H]
    return loss, live_frac
