"""The reconstruction pass of policy ``kvzip``: how much the model needs each cached entry to
repeat its context (``vlm_kv.policies.kvzip``).

    cache = vlm_kv.make_cache(model, "kvzip", 0.1)
    kvzip_prefill(model, cache, context_ids, tokenizer)     # score by reconstruction, then compress
    out = model.generate(input_ids=question_ids, cache=cache, ...)   # ask anything later

The context is prefilled into a full cache, then the model reads a repeat instruction followed by
the context again (teacher-forced, in chunks) with eager attention; an entry's score is the most
any reading query attends to it, over the query heads of its GQA group. The compressed cache is
then filled with the context as usual and keeps the top entries by those scores. Cost: about two
more prefills of the context, once per context (KVzip's own trade: compress once, ask many times).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from vlm_kv.api import cache_kwarg
from vlm_kv.cache.cache import CompressedCache
from vlm_kv.cache.hooks import eager_attention
from vlm_kv.policies.kvzip import KVzipScorer

#: what the model is asked before it reads the context back (KVzip's repeat instruction, our words)
REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"


@torch.no_grad()
def reconstruction_scores(model, input_ids: torch.Tensor, prompt_ids: torch.Tensor,
                          chunk: int = 256) -> list[torch.Tensor]:
    """Per layer, [B, kv_heads, P]: the most attention each of the ``P`` context positions gets
    from the queries that read ``prompt_ids`` + the context back after it."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 token, got {chunk}")
    with eager_attention(model) as adapter:
        cache = DynamicCache(config=model.config)
        arg = {cache_kwarg(model): cache}
        model(input_ids=input_ids, **arg, use_cache=True)
        b, p = input_ids.shape
        kv = adapter.num_kv_heads
        reading = torch.cat([prompt_ids.to(input_ids.device).expand(b, -1), input_ids], dim=1)
        best = [torch.zeros(b, kv, p, device=input_ids.device) for _ in range(adapter.num_layers)]
        for start in range(0, reading.shape[1], chunk):
            attn = model(input_ids=reading[:, start:start + chunk], **arg, use_cache=True,
                         output_attentions=True).attentions
            if attn is None or len(attn) != adapter.num_layers:
                raise RuntimeError("the model returned no attention probabilities for every layer (output_attentions)")
            for layer, probs in enumerate(attn):  # [B, Hq, q, seen]
                seen = probs[..., :p].float().amax(dim=2)  # [B, Hq, P]: over the reading queries
                best[layer] = torch.maximum(best[layer], seen.reshape(b, kv, -1, p).amax(dim=2))
    return best


@torch.no_grad()
def kvzip_prefill(model, cache: CompressedCache, input_ids: torch.Tensor, tokenizer, chunk: int = 256) -> None:
    """Score ``input_ids`` by reconstruction, then prefill them into ``cache`` (a ``kvzip`` cache,
    empty), which keeps the top entries by those scores."""
    scorer = getattr(cache, "scorer", None)
    if not isinstance(cache, CompressedCache) or not isinstance(scorer, KVzipScorer):
        raise ValueError("kvzip_prefill fills a cache made with policy 'kvzip'")
    if not cache.is_empty():
        raise ValueError("kvzip_prefill compresses a context entering an empty cache; this cache already holds tokens")
    prompt = tokenizer(REPEAT_PROMPT, add_special_tokens=False, return_tensors="pt").input_ids
    scorer.load_scores(reconstruction_scores(model, input_ids, prompt, chunk))
    model(input_ids=input_ids, **{cache_kwarg(model): cache}, use_cache=True)
