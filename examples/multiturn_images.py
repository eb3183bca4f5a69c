"""Two turns with a new image each, on one compressed cache (runs offline on a tiny random Qwen2.5-VL).

The pattern for multi-turn with images: keep passing the same cache; each turn passes the
whole conversation's token ids (generate skips what the cache has seen) but ONLY the new
turn's images (pixel_values / image_grid_thw of the images that appear in the new text).
Passing every turn's pixels again fails inside transformers: the vision features would not
match the image tokens of the part generate actually feeds.

    python examples/multiturn_images.py
"""

from __future__ import annotations

import torch

import vlm_kv
from vlm_kv.testing import tiny_inputs, tiny_model


def two_turns(model, cache, max_new_tokens: int = 5) -> torch.Tensor:
    turn1 = tiny_inputs(model, num_images=1, text_len=10, seed=0)
    out1 = model.generate(**turn1, cache=cache, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                          do_sample=False)
    turn2 = tiny_inputs(model, num_images=1, text_len=8, seed=1)  # the new text with its new image
    ids = torch.cat([out1, turn2["input_ids"]], dim=1)           # the whole conversation so far
    images = {k: v for k, v in turn2.items() if k not in ("input_ids", "attention_mask")}  # new pixels only
    out2 = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **images, cache=cache,
                          max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    return out2


def main() -> None:
    model = tiny_model("qwen2_5_vl")
    cache = vlm_kv.make_cache(model, policy="snapkv", budget=0.5,
                              options=vlm_kv.CacheOptions(scorer_kwargs={"window": 4}))
    out = two_turns(model, cache)
    print("tokens:", out.shape[1], "| cache:", cache.stats()["per_modality"], "| eviction steps:", cache.eviction_steps)


if __name__ == "__main__":
    main()
