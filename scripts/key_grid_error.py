"""Squared error of SmolLM2's own keys through the INT2 tier's key grids, per layer (docs/tiers.md, session 8).

    python scripts/key_grid_error.py --text ../shared/data/text/pg1342.txt --offset 200000 [--context 2048]

Prefills the text into a DynamicCache (bf16), cuts every layer's post-RoPE keys into windows of
``--window`` tokens and prints one JSON line per layer: the mean squared error with the fp16 grid
(the paper's) and with the compact 8-bit grid (``key_grid="int8"``), and their ratio.
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    p = argparse.ArgumentParser(prog="scripts/key_grid_error.py")
    p.add_argument("--text", required=True)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--window", type=int, default=8)
    args = p.parse_args()

    from transformers import DynamicCache

    from vlm_kv.eval.fidelity import text_tokens
    from vlm_kv.kernels.int2 import decode_key_grid, dequantize_keys, quantize_keys, quantize_keys_compact
    from vlm_kv.models.smollm2 import load_model

    model, tokenizer = load_model("smollm2", dtype=torch.bfloat16)
    ids = text_tokens(tokenizer, args.text, args.offset, args.context)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    for index, layer in enumerate(cache.layers):
        keys = layer.keys[0]  # [kv heads, tokens, head_dim]
        heads, tokens, dim = keys.shape
        usable = tokens // args.window * args.window
        x = keys[:, :usable].reshape(-1, args.window, dim).float()
        codes, scale, zero = quantize_keys(x)
        fp16 = float(((dequantize_keys(codes, scale, zero) - x) ** 2).mean())
        codes, zero_codes, scale_codes, ref = quantize_keys_compact(x)
        compact = float(((dequantize_keys(codes, *decode_key_grid(zero_codes, scale_codes, ref)) - x) ** 2).mean())
        print(json.dumps({"layer": index, "windows": x.shape[0], "mse_fp16_grid": fp16, "mse_int8_grid": compact,
                          "ratio": compact / fp16}))


if __name__ == "__main__":
    main()
