"""What a calibration probe runs: a window of tokens, the cache that compresses one layer at a
chosen fraction (every other layer full, or at the baseline), and the teacher-forced feed that
measures it against the full cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vlm_kv.cache.cache import CompressedCache
from vlm_kv.cache.hooks import attach
from vlm_kv.config import Budget, CacheOptions
from vlm_kv.eval.teacher_forcing import feed_continuation
from vlm_kv.policies import PolyKV, PolyKVAllocation, policy_spec
from vlm_kv.policies.strategy import LayerEntry, Strategy
from vlm_kv.storage.allocation import Allocation

FULL_LAYER_PATTERN = "streaming_llm"


@dataclass
class Window:
    """One calibration window: ``context`` tokens prefilled (with ``inputs``, the vision tensors
    of an image prompt), then the tokens after them fed one at a time.

    Text windows hold all their tokens from the start. Image windows hold the prompt only; the
    reference run appends ``generate`` greedy tokens of the full cache (their continuation)."""

    source: str
    offset: int
    ids: torch.Tensor      # [1, context + continuation + 1] (image windows: the prompt until the reference ran)
    ref_logps: torch.Tensor | None = None
    ref_hidden: torch.Tensor | None = None
    context: int = 0
    inputs: dict = field(default_factory=dict, repr=False)
    generate: int = 0
    info: dict = field(default_factory=dict)

    def describe(self) -> dict:
        # image windows: the length their reference gives them, whether or not it ran yet
        tokens = self.context + self.generate + 1 if self.generate else int(self.ids.shape[1])
        return {"file": self.source, "offset": self.offset, "tokens": tokens, **self.info}


def feed_token(model, arg: dict, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Feed one token: its next-token log-probs [V], final hidden state [H] and logits [1, 1, V]."""
    out = model(input_ids=token, **arg, use_cache=True, output_hidden_states=True)
    return F.log_softmax(out.logits[0, -1].float(), dim=-1), out.hidden_states[-1][0, -1].float(), out.logits


def feed(model, cache, ids: torch.Tensor, context: int, inputs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs and final hidden states for each continuation token: [M, V], [M, H].
    ``inputs``: vision tensors of the prefill (image prompts)."""
    fed = feed_continuation(model, cache, ids, context, inputs, hidden=True)
    return fed.logps, fed.hidden


def probe_strategy(fingerprint: dict, num_layers: int, layer: int, fraction: float,
                   patterns: dict[str, str], base_pattern: str | None = None, base_fraction: float = 1.0,
                   modality: dict[str, float] | None = None) -> Strategy:
    """``layer`` keeps ``fraction`` of its cache with ``patterns[phase]`` (split between
    modalities by ``modality`` when given); every other layer keeps ``base_fraction`` of its
    cache with ``base_pattern`` (default: its full cache). The global budget is what that
    amounts to."""
    if base_pattern is None:
        base_pattern, base_fraction = FULL_LAYER_PATTERN, 1.0
    layers = {}
    for phase, pattern in patterns.items():
        entries = [LayerEntry(base_pattern, base_fraction / num_layers) for _ in range(num_layers)]
        entries[layer] = LayerEntry(pattern, fraction / num_layers, modality=dict(modality) if modality else None)
        layers[phase] = entries
    total = ((num_layers - 1) * base_fraction + fraction) / num_layers
    return Strategy(model=fingerprint, budget=total, layers=layers).validate()


class LayerFractions(Allocation):
    """A probe's allocation: layer l keeps exactly ``floor(fraction_l * n)`` tokens per head of
    the ``n`` it saw (the run-time shares round the global ``L * cap`` instead, which can move
    up to L tokens onto the one compressed layer of a probe)."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.tokens: torch.Tensor | None = None
        self.inner = PolyKVAllocation(strategy=strategy).inner

    def for_step(self, phase: str, valid_tokens: torch.Tensor) -> Allocation:
        self.phase, self.tokens = phase, valid_tokens
        return self

    def for_layer(self, layer_idx: int) -> Allocation:
        return _FixedLayer(self, layer_idx)


class _FixedLayer(Allocation):
    def __init__(self, owner: LayerFractions, layer_idx: int) -> None:
        self.owner, self.layer_idx = owner, layer_idx

    def layer_capacity(self, layer_idx, num_layers, cap, window) -> torch.Tensor:
        fraction = self.owner.strategy.phase(self.owner.phase)[self.layer_idx].budget * num_layers
        return torch.floor(self.owner.tokens.double() * min(fraction, 1.0)).long()

    def keep_layer(self, scores: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
        return self.owner.inner[self.owner.phase][self.layer_idx].keep_layer(scores, cap)


def probe_cache(model, strategy: Strategy, evict_every: int, seed: int, gates=None) -> CompressedCache:
    """A cache evicting with ``strategy``'s patterns at its exact per-layer fractions; ``gates``
    (a RetentionGates module) are attached only when one of its patterns is gated."""
    adapter = attach(model)
    gated = any(policy_spec(p).needs_gates for p in strategy.patterns())
    if gated and gates is None:
        raise ValueError(f"the probe has gated patterns ({sorted(strategy.patterns())}) but no gates were given")
    return CompressedCache(adapter, PolyKV(strategy=strategy), LayerFractions(strategy), Budget(fraction=1.0),
                           options=CacheOptions(evict_every=evict_every, seed=seed), policy_name="polykv-probe",
                           model_id=id(model), gates=gates if gated else None)
