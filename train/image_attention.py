"""Where the LM looks from a question: attention of chosen query positions onto image segments.

A forward with ``SegmentAttention`` attached records each chosen layer's attention inputs (the
normed hidden states and the rotary tables); ``mass`` then recomputes, for a few query positions
only, that layer's attention probabilities and sums them per segment (image 1, image 2, ...). The
full [T, T] attention of a 3K-token context is never formed, and gradients flow through the
layer's own ``q_proj`` / ``k_proj`` (adapters included), so the same numbers serve as a
diagnostic (``scripts/smollava_image_attention.py``) and as a training signal
(``vlm-kv train-vlm --attention-weight``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.models.llama.modeling_llama import repeat_kv, rotate_half


@dataclass
class QueryTargets:
    """What one sequence asks about: query positions and, per position, the segment it should read."""

    positions: torch.Tensor  # [Q] long: positions of the tokens that predict each answer's first token
    segments: torch.Tensor  # [Q] long: the segment (image index, 0-based) each of them asks about
    key_segments: torch.Tensor  # [T] long: each key position's segment, -1 outside every segment
    n_segments: int


class SegmentAttention:
    """Records the inputs of ``layers``' self-attention during forwards; detach with ``close``."""

    def __init__(self, language_model, layers: list[int]):
        decoder = language_model.layers
        bad = [i for i in layers if not 0 <= i < len(decoder)]
        if bad:
            raise ValueError(f"layers {bad} out of range: the LM has {len(decoder)} layers")
        self.layers = list(layers)
        self._attn = {i: decoder[i].self_attn for i in self.layers}
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._hooks = [self._attn[i].register_forward_pre_hook(self._recorder(i), with_kwargs=True)
                       for i in self.layers]

    def _recorder(self, layer: int):
        def hook(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            self.inputs[layer] = (hidden, cos, sin)
        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.inputs.clear()

    def mass(self, layer: int, row: int, targets: QueryTargets) -> torch.Tensor:
        """[Q, heads, n_segments]: layer ``layer``'s attention probability of each query position of
        sequence ``row`` summed over each segment's keys (causal; float32)."""
        if layer not in self.inputs:
            raise RuntimeError(f"layer {layer} recorded nothing: run a forward with this SegmentAttention attached")
        attn = self._attn[layer]
        hidden, cos, sin = self.inputs[layer]
        h = hidden[row : row + 1]
        pos = targets.positions
        d = attn.head_dim
        q = attn.q_proj(h[:, pos]).view(1, pos.numel(), -1, d).transpose(1, 2)  # [1, Hq, Q, d]
        k = attn.k_proj(h).view(1, h.shape[1], -1, d).transpose(1, 2)  # [1, Hkv, T, d]
        r = row if cos.shape[0] > 1 else 0  # rotary tables are shared across the batch when positions are
        c, s = cos[r : r + 1].unsqueeze(1), sin[r : r + 1].unsqueeze(1)  # [1, 1, T, d]
        q = q * c[:, :, pos] + rotate_half(q) * s[:, :, pos]  # the layer's rotary embedding, queries only
        k = k * c + rotate_half(k) * s
        k = repeat_kv(k, q.shape[1] // k.shape[1])
        scores = (q.float() @ k.float().transpose(-1, -2)) * attn.scaling  # [1, H, Q, T]
        later = torch.arange(h.shape[1]).view(1, -1) > pos.view(-1, 1)  # [Q, T] keys after the query
        probs = scores.masked_fill(later, float("-inf")).softmax(-1)[0]  # [H, Q, T]
        keys = targets.key_segments
        inside = keys >= 0
        out = probs.new_zeros(*probs.shape[:2], targets.n_segments)
        out.index_add_(-1, keys[inside], probs[..., inside])  # summed per segment
        return out.transpose(0, 1)  # [Q, H, S]


def image_targets(input_ids: torch.Tensor, labels: torch.Tensor, asked: list[int], image_token_id: int,
                  tokens_per_image: int, ignore: int) -> QueryTargets:
    """Query targets of one sequence: the image tokens in order make the segments; the position
    before each answer's first label asks about ``asked[j]`` (the j-th answer's image)."""
    where = (input_ids == image_token_id).nonzero().squeeze(1)
    if where.numel() % tokens_per_image:
        raise ValueError(f"{where.numel()} image tokens is not a multiple of {tokens_per_image}")
    key_segments = torch.full_like(input_ids, -1)
    key_segments[where] = torch.arange(where.numel()) // tokens_per_image
    answer = labels != ignore
    starts = (answer & ~torch.cat([answer.new_zeros(1), answer[:-1]])).nonzero().squeeze(1)
    if starts.numel() != len(asked):
        raise ValueError(f"{starts.numel()} answers in the labels, {len(asked)} asked images")
    return QueryTargets(positions=starts - 1, segments=torch.tensor(asked), key_segments=key_segments,
                        n_segments=where.numel() // tokens_per_image)
