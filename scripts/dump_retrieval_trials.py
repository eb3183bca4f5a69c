"""Write the retrieval trials' token ids to JSON, so that a tool that cannot import vlm_kv
(kvpress pins an older transformers) runs exactly the same trials.

    python scripts/dump_retrieval_trials.py --ask later --out docs/retrieval/kvpress_kvzip/trials_later.json

Same settings as docs/retrieval/run.sh: SmolLM2's tokenizer, pg84 from character 100000, a
1024-token haystack, depths 0.1 / 0.5 / 0.9, 8 trials a depth, fact seed 0.
"""

from __future__ import annotations

import argparse
import json

from vlm_kv.eval.retrieval import RetrievalSettings, _prompt_ids, build_trials

from vlm_kv.models.smollm2 import load_smollm2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--text", default="../shared/data/text/pg84.txt")
    p.add_argument("--offset", type=int, default=100000)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ask", choices=("later", "prompt"), default="later")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    _, tokenizer = load_smollm2()
    settings = RetrievalSettings(context=args.context, depths=(0.1, 0.5, 0.9), trials=args.trials, offset=args.offset,
                                 seed=args.seed, ask=args.ask)
    specs = build_trials(tokenizer, args.text, settings)
    rows = []
    for spec in specs:
        ids = _prompt_ids(tokenizer, spec, args.ask)
        rows.append({"depth": spec["depth"], "trial": spec["trial"], "code": spec["code"],
                     "input_ids": ids["input_ids"][0].tolist(),
                     "context_ids": ids["context_ids"][0].tolist() if "context_ids" in ids else None})
    with open(args.out, "w") as fh:
        json.dump({"settings": vars(args), "trials": rows}, fh)
    print(f"{len(rows)} trials -> {args.out}")


if __name__ == "__main__":
    main()
