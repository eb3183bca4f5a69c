"""Attention-level error of 2-bit keys in different bases, on SmolLM2's own queries and keys (docs/tiers.md, session 9).

Runs SmolLM2 (bf16) over 2048 tokens of a text, keeps every layer's queries and post-RoPE keys,
quantizes the keys of positions 8 .. 1856 in windows of 8 (per channel, fp16 grid) and reports,
averaged over layers, heads and the last 128 queries, KL(softmax(q k) || softmax(q k_hat)) for:
``channel`` (as stored), ``pre`` (RoPE undone first), ``hadamard`` (k @ H), ``pca`` (per kv head,
the eigenbasis of within-window key deviations on a second passage), ``pre_hadamard``, and
``channel_bias`` (the channel basis with the expected exp-bias of uniform rounding noise,
sum_d (q_d s_d / 2)^2 / 6, subtracted from each quantized logit). For values it reports the relative
squared error of the attention output (exact weights, the same positions' values quantized per token)
in the channel and the Hadamard basis, per layer and averaged.

    python scripts/key_basis_attention_kl.py --text ../shared/data/text/pg84.txt --offset 100000 --calib-offset 200000
"""

from __future__ import annotations

import argparse
import json

import torch


def _capture(model, tok, text: str, offset: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ids = tok(text[offset:], return_tensors="pt").input_ids[:, :length]
    got = []

    def capture(module, query, key, value, attention_mask, **kw):
        got.append((query[0].float(), key[0].float(), value[0].float()))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("capture_qk", capture)
    model.config._attn_implementation = "capture_qk"
    with torch.no_grad():
        model(ids)
    model.config._attn_implementation = "sdpa"
    return got


def main() -> None:
    from vlm_kv.kernels.int2 import dequantize_keys, dequantize_values, hadamard_basis, quantize_keys, quantize_values
    from vlm_kv.tiers.rope_keys import KeyRotation
    from vlm_kv.models.smollm2 import load_smollm2

    p = argparse.ArgumentParser()
    p.add_argument("--text", required=True)
    p.add_argument("--offset", type=int, default=100000)
    p.add_argument("--calib-offset", type=int, default=200000)
    args = p.parse_args()
    model, tok = load_smollm2(torch.bfloat16)
    text = open(args.text, encoding="utf-8").read()
    n_ctx, n_q, w = 2048, 128, 8
    cap = _capture(model, tok, text, args.offset, n_ctx)
    calib = _capture(model, tok, text, args.calib_offset, n_ctx)
    rope = KeyRotation.from_model(model, uses_mrope=False)
    region = slice(8, 8 + ((n_ctx - n_q - 64 - 8) // w) * w)
    pos = torch.arange(n_ctx)[region]
    mask = torch.arange(n_ctx)[None] <= torch.arange(n_ctx - n_q, n_ctx)[:, None]

    def qdq(x):
        h, n, d = x.shape
        c, s, z = quantize_keys(x.reshape(h * n // w, w, d))
        return dequantize_keys(c, s, z).view(h, n, d), s.float().view(h, n // w, d)

    def softmax(logits):
        return torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)

    def kl(p, q):
        return float((p * (p.clamp_min(1e-30).log() - q.clamp_min(1e-30).log())).sum(-1).mean())

    schemes = ("channel", "pre", "hadamard", "pca", "pre_hadamard", "channel_bias")
    total = dict.fromkeys(schemes, 0.0)
    value_error = {"channel": [], "hadamard": []}
    for (q, k, v), (qc, kc, _) in zip(cap, calib):
        q = q[:, -n_q:]
        hk, d = k.shape[0], k.shape[-1]
        g = q.shape[0] // hk
        scale = d ** -0.5
        hmat = hadamard_basis(d)
        dev = kc[:, 8:8 + 1920].reshape(hk, -1, w, d)
        dev = (dev - dev.mean(2, keepdim=True)).reshape(hk, -1, d)
        pca = torch.stack([torch.linalg.eigh(x.T @ x).eigenvectors for x in dev])  # [hk, d, d] columns = basis
        ref = softmax(q @ k.repeat_interleave(g, 0).transpose(1, 2) * scale)
        out = ref @ v.repeat_interleave(g, 0)
        for name, basis in (("channel", torch.eye(d)), ("hadamard", hmat)):
            vq = v.clone()
            win = v[:, region].reshape(-1, w, d) @ basis
            vq[:, region] = (dequantize_values(*quantize_values(win)) @ basis.T).view(hk, -1, d)
            err = ((ref @ vq.repeat_interleave(g, 0) - out) ** 2).sum() / (out ** 2).sum()
            value_error[name].append(round(float(err), 5))
        reg = k[:, region]
        for name in schemes:
            kq = k.clone()
            bias = None
            if name in ("channel", "channel_bias"):
                kq[:, region], s = qdq(reg)
                if name == "channel_bias":
                    a = q.abs()[:, :, None, :] * s.repeat_interleave(g, 0)[:, None] * scale / 2  # [hq, nq, windows, d]
                    bias = torch.zeros(q.shape[0], n_q, n_ctx)
                    bias[..., region] = ((a ** 2) / 6).sum(-1).repeat_interleave(w, -1)
            elif name == "pre":
                kq[:, region] = rope.rotate(qdq(rope.unrotate(reg, pos))[0], pos)
            elif name == "hadamard":
                kq[:, region] = qdq(reg @ hmat)[0] @ hmat
            elif name == "pca":
                kq[:, region] = qdq(reg @ pca)[0] @ pca.transpose(1, 2)
            else:
                kq[:, region] = rope.rotate(qdq(rope.unrotate(reg, pos) @ hmat)[0] @ hmat, pos)
            logits = q @ kq.repeat_interleave(g, 0).transpose(1, 2) * scale
            total[name] += kl(ref, softmax(logits if bias is None else logits - bias)) / len(cap)
    print(json.dumps({"text": args.text.split("/")[-1], "offset": args.offset, "calib_offset": args.calib_offset,
                      "attention_kl": {k: round(v, 5) for k, v in total.items()},
                      "value_output_error_mean": {k: round(sum(e) / len(e), 5) for k, e in value_error.items()},
                      "value_output_error_per_layer": value_error}))


if __name__ == "__main__":
    main()
