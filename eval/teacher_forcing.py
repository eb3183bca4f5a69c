"""Teacher forcing on a cache: prefill a context, then feed the tokens after it one at a time and
keep each step's next-token log-probs (and final hidden states when asked). Fidelity and
calibration both measure caches this way."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from vlm_kv.api import cache_kwarg


@dataclass
class Continuation:
    """What feeding the continuation gave, one row per fed token."""

    logps: torch.Tensor               # [M, V] float32 next-token log-probs
    hidden: torch.Tensor | None       # [M, H] float32 final hidden states (when asked for)
    ms_per_token: float               # wall time of a decode step, prefill excluded


@torch.no_grad()
def feed_continuation(model, cache, ids: torch.Tensor, context: int, inputs: dict | None = None,
                      hidden: bool = False, progress: bool = False, label: str = "") -> Continuation:
    """Prefill ``ids[:, :context]`` (with ``inputs``: the vision tensors of an image prompt) into
    ``cache``, then feed ``ids[:, context:-1]`` one token at a time."""
    arg = {cache_kwarg(model): cache}
    model(input_ids=ids[:, :context], **(inputs or {}), **arg, use_cache=True)
    steps = ids.shape[1] - 1 - context
    logps, states = [], []
    start = time.perf_counter()
    for i in tqdm(range(steps), desc=label, disable=not progress, leave=False):
        out = model(input_ids=ids[:, context + i : context + i + 1], **arg, use_cache=True,
                    output_hidden_states=hidden)
        logps.append(F.log_softmax(out.logits[0, -1].float(), dim=-1))
        if hidden:
            states.append(out.hidden_states[-1][0, -1].float())
    elapsed = (time.perf_counter() - start) / max(steps, 1)
    return Continuation(torch.stack(logps), torch.stack(states) if hidden else None, elapsed * 1000)
