"""A reconstruction teacher for gate training: KVzip's kept set as a ranking target (issue 26).

The gates are trained to continue text (distillation) under a capacity term; nothing in that tells
them which entries a question asked later will need. KVzip answers later questions better than the
gates at 5 % of a 2048-token context (docs/retrieval.md, sessions 29-34) and chooses its entries by
what the model attends to when it repeats the context. This module turns that choice into a target
the gates can learn from, per training sample:

* ``reconstruction_kept``: the entries KVzip would keep at a budget fraction ``f`` of the sample,
  one ranking over every layer and head (``vlm_kv.reconstruction``'s read-back pass, its sinks
  always kept), or, with ``per_layer``, ``f`` of each layer's entries ranked within the layer (KVzip's
  choice of entries inside a layer, the split between layers left to the gates);
* ``ranking_loss``: the gates' own ranking at the end of the sample, score ``(T - 1 - i) * log
  beta_i`` (what DBTrimKV evicts by), held against that set: a class-balanced logistic loss on the
  score's log decay, ``-log(-score)``, minus the gates' own ``f`` threshold in the same units, so the
  gradient moves entries across the line the cache would draw. Why the log: on the raw score the loss
  has a way out that ranks nothing (every ``log beta`` scaled towards 0 shrinks every margin, and a
  balanced loss of margins near 0 is log 2, below a poor ranking's); session 35's first runs took it
  (the live fraction rose from 0.09 to 0.34 while the loss fell to 0.66). Scaling every ``log beta``
  by one factor shifts every log decay alike, which the threshold absorbs. Also returned: the share of
  KVzip's kept entries that the gates keep at the same budget (``agreement``, for the log).

The read-back costs about two more forwards of the sample without gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlm_kv.reconstruction import plan_read_back, reconstruction_scores

#: decay (nats) below which entries count as equally fresh: the newest entry has none at all
_DECAY_FLOOR = 1e-6


@dataclass(frozen=True)
class RankingTerms:
    loss: torch.Tensor       # scalar, with gradients into the gates
    agreement: torch.Tensor  # scalar in [0, 1], detached


def _ranked_groups(x: torch.Tensor, per_layer: bool) -> torch.Tensor:
    """[L, B, H, T] -> the groups ranked together, [groups, entries]: one per sample, or per (layer, sample)."""
    n_layers, b, h, t = x.shape
    return x.reshape(n_layers * b, h * t) if per_layer else x.permute(1, 0, 2, 3).reshape(b, n_layers * h * t)


def _ungroup(x: torch.Tensor, shape: torch.Size, per_layer: bool) -> torch.Tensor:
    n_layers, b, h, t = shape
    return x.reshape(shape) if per_layer else x.reshape(b, n_layers, h, t).permute(1, 0, 2, 3)


def _top_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per row of ``scores`` [B, N]: True on its ``k`` largest entries (ties by index)."""
    idx = scores.topk(k, dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)


def kept_count(fraction: float, entries: int) -> int:
    if not 0 < fraction <= 1:
        raise ValueError(f"teacher budget fraction must be in (0, 1], got {fraction}")
    return max(1, min(entries, round(fraction * entries)))


@torch.no_grad()
def reconstruction_kept(model: torch.nn.Module, tokenizer, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        fraction: float, sinks: int = 4, per_layer: bool = False) -> torch.Tensor:
    """KVzip's kept set at ``fraction`` of every layer's and head's entries: bool [L, B, H, T]; ranked over
    all layers, or within each layer (``per_layer``).

    Rows must be unpadded (a read-back of padding would score it); a padded batch raises."""
    if not bool(attention_mask.bool().all()):
        raise ValueError("the reconstruction teacher reads each sample back whole: train it with unpadded rows "
                         "(--batch-size 1, or samples of one length)")
    plan = plan_read_back(tokenizer, input_ids)
    scores = torch.stack(reconstruction_scores(model, input_ids, plan, sinks=sinks))  # [L, B, H, T]
    scores[..., :sinks] = float("inf")  # KVzip always keeps its sinks
    flat = _ranked_groups(scores, per_layer)
    return _ungroup(_top_mask(flat, kept_count(fraction, flat.shape[1])), scores.shape, per_layer)


def ranking_loss(log_betas: list[torch.Tensor], kept: torch.Tensor, temperature: float = 1.0,
                 per_layer: bool = False) -> RankingTerms:
    """The gates' end-of-sample ranking held against ``kept`` ([L, B, H, T] bool, from
    ``reconstruction_kept`` with the same ``per_layer``); ``log_betas``: per layer [B, H, T]."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    log_beta = torch.stack(log_betas).float()  # [L, B, H, T]
    if log_beta.shape != kept.shape:
        raise ValueError(f"teacher kept set {tuple(kept.shape)} does not match the gates' {tuple(log_beta.shape)}")
    t = log_beta.shape[-1]
    age = torch.arange(t - 1, -1, -1, device=log_beta.device, dtype=log_beta.dtype)
    # log decay, higher = kept longer; ranks as the score does
    score = -torch.log(_ranked_groups(-(age * log_beta), per_layer) + _DECAY_FLOOR)  # [groups, entries]
    target = _ranked_groups(kept.to(score.device), per_layer)
    k = int(target.sum(-1).min())
    threshold = score.detach().topk(k, dim=-1).values[:, -1:]
    logits = (score - threshold) / temperature
    per_entry = F.binary_cross_entropy_with_logits(logits, target.float(), reduction="none")
    # the newest entry has no decay whatever its beta: nothing to learn there, and its fixed score would
    # make the loss depend on the scale of the others
    aged = _ranked_groups((age > 0).expand_as(log_beta), per_layer).float()
    pos = target.float() * aged
    neg = (1.0 - target.float()) * aged
    loss = 0.5 * ((per_entry * pos).sum() / pos.sum().clamp(min=1) + (per_entry * neg).sum() / neg.sum().clamp(min=1))
    with torch.no_grad():
        gates_kept = _top_mask(score.detach(), k)
        agreement = (gates_kept & target).sum().float() / target.sum().clamp(min=1)
    return RankingTerms(loss, agreement)
