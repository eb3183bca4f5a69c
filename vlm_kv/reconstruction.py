"""The reconstruction pass of policy ``kvzip``: how much the model needs each cached entry to
repeat its context (``vlm_kv.policies.kvzip``).

    cache = vlm_kv.make_cache(model, "kvzip", 0.1)
    kvzip_prefill(model, cache, context_ids, tokenizer)     # score by reconstruction, then compress
    out = model.generate(input_ids=question_ids, cache=cache, ...)   # ask anything later

The context is prefilled into a full cache; then, chunk by chunk, the model reads a repeat
instruction (as the user, then its own reply starts) followed by that chunk of the context again,
teacher-forced, with eager attention. An entry's score is the most any reading query attends to
it, over the query heads of its GQA group, with the attention renormalised over what the reading
is about: the cache's sink entries (``KVzipScorer.num_sinks``, always kept), the chunk being repeated and the read-back itself (KVzip's
scoring; kvpress's ``KVzipPress`` does the same). Each chunk's read-back leaves the cache before
the next. The chat template's header (a system prompt, the user tag) is not read back: it scores
0, sinks aside. The compressed cache is then filled with the context as usual and keeps the top
entries by those scores. Cost: about two more prefills of the context, once per context
(KVzip's own trade: compress once, ask many times).

``ReadBack`` holds the layout; its switches exist for the ablation in
``scripts/kvzip_readback_ablation.py`` (docs/retrieval.md: what each part is worth on SmolLM2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from vlm_kv.api import cache_kwarg
from vlm_kv.cache.cache import CompressedCache
from vlm_kv.cache.hooks import eager_attention
from vlm_kv.policies.kvzip import KVzipScorer

# a user message no template rewrites, to find the text a chat template puts around a message
_MARK = "\u2063vlm-kv-context\u2063"


@dataclass(frozen=True)
class ReadBack:
    """How the context is read back to score it.

    ``prompt``: the repeat instruction before the first chunk (KVzip's); ``resume_prompt``: the one
    before each later chunk, followed by the last ``overlap`` tokens of the chunk before it.
    ``chunk``: context tokens read back per pass. ``assistant_turn``: with a chat template, the
    instruction closes the user turn and the read-back is the assistant's reply (without one, a
    newline). ``local_softmax``: renormalise each reading query's attention over the sinks, the
    chunk and the read-back (False: over the whole cache). ``skip_template_prefix``: the chat
    template's header before the first message is not read back.
    """

    prompt: str = "\n\nRepeat the previous context exactly."
    resume_prompt: str = "\n\nGo on repeating the previous context exactly, from:"
    overlap: int = 8
    chunk: int = 2048
    assistant_turn: bool = True
    local_softmax: bool = True
    skip_template_prefix: bool = True

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"ReadBack.chunk must be >= 1 token, got {self.chunk}")
        if self.overlap < 0:
            raise ValueError(f"ReadBack.overlap must be >= 0, got {self.overlap}")


@dataclass(frozen=True)
class ReadChunk:
    """One pass of the read-back: context positions ``start:end`` and the tokens the model reads
    for them (instruction, reply header, then ``context[start:end]``), ``[B, q]``."""

    start: int
    end: int
    reading: torch.Tensor


def chat_wrapping(tokenizer) -> tuple[str, str]:
    """The text a chat template puts before a user message (header, default system prompt) and
    after it when the assistant's reply starts; ``("", "\\n")`` without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return "", "\n"
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                         add_generation_prompt=True)
    if text.count(_MARK) != 1:
        raise ValueError("the chat template does not place a user message verbatim; cannot find its reply header")
    before, after = text.split(_MARK)
    return before, after


def _ids(tokenizer, text: str) -> torch.Tensor:
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


def plan_read_back(tokenizer, input_ids: torch.Tensor, settings: ReadBack = ReadBack()) -> list[ReadChunk]:
    """The passes that read ``input_ids`` ([B, P], one context per row) back."""
    b, p = input_ids.shape
    header, reply = chat_wrapping(tokenizer)
    start = 0
    if settings.skip_template_prefix and header:
        head = _ids(tokenizer, header).to(input_ids.device)
        n = head.shape[1]
        if n < p and torch.equal(input_ids[:, :n], head.expand(b, -1)):
            start = n
    suffix = _ids(tokenizer, reply if settings.assistant_turn else "\n").to(input_ids.device)
    first = _ids(tokenizer, settings.prompt).to(input_ids.device)
    resume = _ids(tokenizer, settings.resume_prompt).to(input_ids.device)
    plan = []
    for s in range(start, p, settings.chunk):
        e = min(s + settings.chunk, p)
        if s == start:
            lead = first.expand(b, -1)
        else:
            lead = torch.cat([resume.expand(b, -1), input_ids[:, max(start, s - settings.overlap):s]], dim=1)
        plan.append(ReadChunk(s, e, torch.cat([lead, suffix.expand(b, -1), input_ids[:, s:e]], dim=1)))
    return plan


class _AttentionTaps:
    """Forward hooks that reduce each layer's attention probabilities to per-entry maxima as the
    layer runs, then drop them (holding every layer's [B, Hq, q, k] at once is what costs)."""

    def __init__(self, modules: list[torch.nn.Module], kv_heads: int, best: list[torch.Tensor]):
        self.kv_heads, self.best = kv_heads, best
        self.chunk: ReadChunk | None = None
        self.context_len = 0
        self.sinks = 0
        self.local = True
        self.handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(modules)]

    def _hook(self, layer: int):
        def hook(module, args, output):
            if not isinstance(output, tuple) or len(output) < 2 or output[1] is None:
                raise RuntimeError(f"attention module {layer} returned no probabilities under eager attention")
            self._reduce(layer, output[1])
            return (output[0], None, *output[2:])
        return hook

    def _reduce(self, layer: int, probs: torch.Tensor) -> None:
        chunk, p = self.chunk, self.context_len
        probs = probs.float()  # [B, Hq, q, k]: k = p + q
        b, hq, _, k = probs.shape
        if self.local:
            keep = torch.zeros(k, dtype=torch.bool, device=probs.device)
            keep[: min(self.sinks, chunk.start)] = True
            keep[chunk.start:chunk.end] = True
            keep[p:] = True
            probs = probs * keep
            probs = probs / probs.sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
            lo, hi = chunk.start, chunk.end
        else:
            lo, hi = 0, p
        seen = probs[..., lo:hi].amax(dim=2).reshape(b, self.kv_heads, hq // self.kv_heads, hi - lo).amax(dim=2)
        self.best[layer][..., lo:hi] = torch.maximum(self.best[layer][..., lo:hi], seen)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def reconstruction_scores(model, input_ids: torch.Tensor, plan: list[ReadChunk], *, sinks: int = 4,
                          local_softmax: bool = True) -> list[torch.Tensor]:
    """Per layer, [B, kv_heads, P]: the most attention each of the ``P`` context positions gets
    from the queries that read it back (``plan``, from ``plan_read_back``); 0 for positions no
    chunk covers."""
    b, p = input_ids.shape
    for c in plan:
        if not 0 <= c.start < c.end <= p or c.reading.shape[0] != b:
            raise ValueError(f"read-back chunk {c.start}:{c.end} does not fit a context of {p} tokens and {b} rows")
    with eager_attention(model) as adapter:
        cache = DynamicCache(config=model.config)
        arg = {cache_kwarg(model): cache}
        model(input_ids=input_ids, **arg, use_cache=True)
        best = [torch.zeros(b, adapter.num_kv_heads, p, device=input_ids.device) for _ in range(adapter.num_layers)]
        taps = _AttentionTaps(adapter.attention_modules(model), adapter.num_kv_heads, best)
        taps.context_len, taps.sinks, taps.local = p, sinks, local_softmax
        try:
            for chunk in plan:
                taps.chunk = chunk
                model(input_ids=chunk.reading.to(input_ids.device), **arg, use_cache=True)
                # the read-back leaves (a negative count removes that many, in transformers 4 and 5)
                cache.crop(-chunk.reading.shape[1])
        finally:
            taps.remove()
    return best


@torch.no_grad()
def kvzip_prefill(model, cache: CompressedCache, input_ids: torch.Tensor, tokenizer,
                  read_back: ReadBack = ReadBack(), memo: dict | None = None) -> None:
    """Score ``input_ids`` by reconstruction, then prefill them into ``cache`` (a ``kvzip`` cache,
    empty), which keeps the top entries by those scores.

    ``memo``: a dict the caller keeps for one model; scores are stored there by context and
    read-back layout, so the same context at another budget is not read back again (a sweep)."""
    scorer = getattr(cache, "scorer", None)
    if not isinstance(cache, CompressedCache) or not isinstance(scorer, KVzipScorer):
        raise ValueError("kvzip_prefill fills a cache made with policy 'kvzip'")
    if not cache.is_empty():
        raise ValueError("kvzip_prefill compresses a context entering an empty cache; this cache already holds tokens")
    key = (tuple(input_ids.shape), input_ids.cpu().numpy().tobytes(), read_back, scorer.num_sinks)
    scores = memo.get(key) if memo is not None else None
    if scores is None:
        plan = plan_read_back(tokenizer, input_ids, read_back)
        scores = reconstruction_scores(model, input_ids, plan, sinks=scorer.num_sinks,
                                       local_softmax=read_back.local_softmax)
        if memo is not None:
            memo[key] = scores
    scorer.load_scores(scores)
    model(input_ids=input_ids, **{cache_kwarg(model): cache}, use_cache=True)
