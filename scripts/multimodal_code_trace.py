"""Where a tiered cache holds the sign's characters when a multi-turn chat asks for a code (issue 22).

At 0.1 of the bytes the tiered gates lose 10 of the 181 multi-turn answers that the full cache
gives on code questions, most as the code with characters missing ("AY8" for AY8L;
docs/smollava/multi_turn_misses). This reruns the chats holding code questions with a compressed
cache and, when each code question's first answer token is predicted (after the question was
prefilled and the cache compressed), records for each of the code's four character patches how
many KV heads of each layer hold it in full precision, in INT2, or not at all. Questions are then
grouped by whether the cache answered them, and characters by whether the answer kept them, so a
lost character can be told evicted from quantized.

    OMP_NUM_THREADS=1 python scripts/multimodal_code_trace.py --seeds 1,2 --items 16 --budget 0.1 \
        --out docs/smollava/multi_turn_code_trace/budget_0.1 --full-from \
        docs/smollava/multi_turn_step4500/tiered_gates3050_records docs/smollava/multi_turn_step4500_seed2/tiered_gates3050_records
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from vlm_kv.eval.visual_qa import answer
from vlm_kv.eval.visual_tasks import GRID, answer_matches, make_item, normalize_answer

from vlm_kv.api import make_cache
from vlm_kv.models.named import load_vlm
from vlm_kv.models.smollava import IMAGE_TOKEN_ID, IMAGE_TOKENS

TIERS = ("fp", "int2", "evicted")


class TurnProbe(LogitsProcessor):
    """Calls ``inspect(input_ids)`` once per ``generate`` call: at its first step, when the cache holds
    the turn's prompt (a later step sees one more token than the step before)."""

    def __init__(self, inspect):
        self.inspect, self.last = inspect, None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        length = input_ids.shape[1]
        if self.last is None or length != self.last + 1:
            self.inspect(input_ids)
        self.last = length
        return scores


def image_positions(input_ids: torch.Tensor, image: int) -> list[int]:
    """Sequence positions of image ``image``'s patches (0-based image index), row-major."""
    image_pos = (input_ids[0] == IMAGE_TOKEN_ID).nonzero().flatten()
    block = image_pos[image * IMAGE_TOKENS:(image + 1) * IMAGE_TOKENS]
    if block.numel() != IMAGE_TOKENS:
        raise ValueError(f"image {image} has {block.numel()} tokens in the sequence, expected {IMAGE_TOKENS}")
    return block.tolist()


def patch_positions(input_ids: torch.Tensor, image: int, sign_cell: tuple[int, int], length: int) -> list[int]:
    """Sequence positions of the ``length`` patches right of ``sign_cell`` in image ``image`` (0-based)."""
    row, col = sign_cell
    return image_positions(input_ids, image)[row * GRID + col:row * GRID + col + length]


def tier_counts(cache, positions: list[int]) -> list[dict[str, list[int]]]:
    """Per position: per layer, KV heads holding it in full precision, in INT2, and not at all."""
    counts = [{t: [] for t in TIERS} for _ in positions]
    for layer in cache.layers:
        held, tier = (t[0] for t in layer.held_positions())  # row 0: [H, L]
        for c, p in zip(counts, positions):
            fp = int(((held == p) & (tier == 0)).any(-1).sum())
            q = int(((held == p) & (tier == 1)).any(-1).sum())
            c["fp"].append(fp)
            c["int2"].append(q)
            c["evicted"].append(held.shape[0] - fp - q)
    return counts


def tier_totals(cache, positions: list[int]) -> dict[str, int]:
    """(layer, KV head, position) slots of ``positions`` in full precision, in INT2 and evicted, summed."""
    wanted = torch.tensor(positions)
    totals = dict.fromkeys(TIERS, 0)
    for layer in cache.layers:
        held, tier = (t[0] for t in layer.held_positions())
        hit = torch.isin(held, wanted.to(held.device))
        totals["fp"] += int((hit & (tier == 0)).sum())
        totals["int2"] += int((hit & (tier == 1)).sum())
        totals["evicted"] += held.shape[0] * len(positions)
    totals["evicted"] -= totals["fp"] + totals["int2"]
    return totals


def kept_characters(expected: str, given: str) -> list[bool]:
    """Which characters of ``expected`` the answer kept, in order (a longest common subsequence)."""
    a, b = expected.upper(), normalize_answer(given).upper()
    table = np.zeros((len(a) + 1, len(b) + 1), int)
    for i in range(len(a) - 1, -1, -1):
        for j in range(len(b) - 1, -1, -1):
            table[i, j] = table[i + 1, j + 1] + 1 if a[i] == b[j] else max(table[i + 1, j], table[i, j + 1])
    kept, i, j = [False] * len(a), 0, 0
    while i < len(a) and j < len(b):
        if a[i] == b[j]:
            kept[i], i, j = True, i + 1, j + 1
        elif table[i + 1, j] >= table[i, j + 1]:
            i += 1
        else:
            j += 1
    return kept


def trace_item(model, tokenizer, item, cache_kwargs: dict, policy: str, budget: float) -> list[dict]:
    cache = make_cache(model, policy, budget, **cache_kwargs)
    seen: list[dict] = []

    def inspect(input_ids):
        q = item.questions[len(seen)]
        record = {"turn": len(seen) + 1, "kind": q.kind}
        if q.kind == "code":
            scene = item.scenes[q.image_index]
            pos = patch_positions(input_ids, q.image_index, scene.sign_cell, len(scene.code))
            image = image_positions(input_ids, q.image_index)
            others = [int(p) for p in (input_ids[0] == IMAGE_TOKEN_ID).nonzero().flatten() if int(p) not in image]
            record.update(positions=pos, chars=tier_counts(cache, pos), context=int(input_ids.shape[1]),
                          image_rest=tier_totals(cache, [p for p in image if p not in pos]),
                          other_images=tier_totals(cache, others))
        seen.append(record)

    answers = answer(model, tokenizer, item, 8, cache=cache, logits_processor=LogitsProcessorList([TurnProbe(inspect)]))
    if len(seen) != len(item.questions):
        raise RuntimeError(f"probed {len(seen)} turns of {len(item.questions)}")
    rows = []
    for q, given, record in zip(item.questions, answers, seen):
        if q.kind != "code":
            continue
        rows.append({"item": item.index, "turn": record["turn"], "image": q.image_index + 1, "images": len(item.scenes),
                     "answer": q.answer, "given": given, "correct": answer_matches(given, q.answer),
                     "kept": kept_characters(q.answer, given), "context": record["context"],
                     "positions": record["positions"], "chars": record["chars"],
                     "image_rest": record["image_rest"], "other_images": record["other_images"]})
    return rows


def _shares(chars: list[dict]) -> dict[str, float]:
    totals = {t: sum(sum(c[t]) for c in chars) for t in TIERS}
    n = sum(totals.values())
    return {t: totals[t] / n if n else float("nan") for t in TIERS}


def summarize(rows: list[dict]) -> dict:
    """Share of (layer, head) slots in each tier, for the characters of answered questions and, of lost
    ones (wrong here, right with the full cache where ``full_correct`` is known), the characters the
    answer kept / dropped; with the counts behind each."""
    lost = [r for r in rows if not r["correct"] and r.get("full_correct", True)]
    groups = {
        "answered questions, every character": [c for r in rows if r["correct"] for c in r["chars"]],
        "lost questions, characters the answer kept": [c for r in lost for c, k in zip(r["chars"], r["kept"]) if k],
        "lost questions, characters the answer dropped": [c for r in lost for c, k in zip(r["chars"], r["kept"]) if not k],
    }
    out = {name: {"characters": len(chars), **_shares(chars),
                   "layers_with_no_fp_head": float(np.mean([sum(f == 0 for f in c["fp"]) for c in chars])) if chars else None,
                   "fp_heads_per_layer": (np.mean([c["fp"] for c in chars], axis=0).round(2).tolist() if chars else None)}
           for name, chars in groups.items()}
    # what the characters are compared with: the asked image's other patches, and the other images' patches
    for key, name in (("image_rest", "the asked image's other patches"), ("other_images", "the other images' patches")):
        totals = {t: sum(r[key][t] for r in rows if key in r) for t in TIERS}
        n = sum(totals.values())
        out[name] = {"characters": None, **{t: totals[t] / n if n else float("nan") for t in TIERS},
                     "layers_with_no_fp_head": None, "fp_heads_per_layer": None}
    return out


def to_markdown(summary: dict, rows: list[dict], header: str) -> str:
    lines = [header, "", "| characters | count | full precision | INT2 | evicted | layers with no FP head (of 30) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, s in summary.items():
        if s["characters"] == 0:
            lines.append(f"| {name} | 0 | - | - | - | - |")
            continue
        count = "patches" if s["characters"] is None else s["characters"]
        no_fp = "-" if s["layers_with_no_fp_head"] is None else f"{s['layers_with_no_fp_head']:.1f}"
        lines.append(f"| {name} | {count} | {s['fp']:.3f} | {s['int2']:.3f} | {s['evicted']:.3f} | {no_fp} |")
    lines += ["", "Lost questions, per character (heads in full precision / INT2 / evicted, summed over layers):", "",
              "| seed | item | turn | image | expected | given | per character |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["correct"] or not r.get("full_correct", True):
            continue
        cells = ", ".join(f"{ch}{'' if k else '(dropped)'} {sum(c['fp'])}/{sum(c['int2'])}/{sum(c['evicted'])}"
                          for ch, k, c in zip(r["answer"], r["kept"], r["chars"]))
        lines.append(f"| {r['seed']} | {r['item']} | {r['turn']} | {r['image']} ({r['images']}) | {r['answer']} | "
                     f"{r['given']!r} | {cells} |")
    return "\n".join(lines) + "\n"


def full_answers(folders: list[str]) -> dict[tuple[int, int, int], bool]:
    """(data seed, item, turn) -> whether the full cache answered, from sweep folders' full rows."""
    out = {}
    for folder in folders:
        table = json.loads((Path(folder) / "sweep_multimodal.json").read_text())
        seed = table["settings"]["data_seed"]
        for row in table["rows"]:
            if row["policy"] == "full" and row["task"] == "multi_turn":
                if "questions" not in row:
                    raise SystemExit(f"{folder}: the full row has no per-question records (rerun the sweep)")
                out.update({(seed, q["item"], q["turn"]): q["full_correct"] for q in row["questions"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollava")
    ap.add_argument("--seeds", default="1,2", help="held-out data seeds")
    ap.add_argument("--items", type=int, default=16, help="multi-turn items per seed, as in the sweep")
    ap.add_argument("--policy", default="dbtrimkv")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--gates", default="train/checkpoints/smollava-3050/gates")
    ap.add_argument("--tiers", default="int2", help="int2, or none for the untiered cache")
    ap.add_argument("--out", required=True, help="folder for trace.json and trace.md (resumes from trace.json)")
    ap.add_argument("--full-from", nargs="*", default=[],
                    help="sweep folders of the same items (any data seed) whose full-cache rows tell which "
                         "questions the full cache answers: only those count as lost")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "trace.json"
    settings = {k: v for k, v in vars(args).items() if k != "full_from"}  # a join, not what was traced
    state = json.loads(path.read_text()) if path.is_file() else {"settings": settings, "rows": [], "done": []}
    if state["settings"] != settings:
        raise SystemExit(f"{path} was written with other settings: {state['settings']}")
    model, processor = load_vlm(args.model, "cpu")
    cache_kwargs = {"gates": args.gates} if args.gates else {}
    if args.tiers != "none":
        cache_kwargs["tiers"] = args.tiers
    for seed in (int(s) for s in args.seeds.split(",")):
        for index in range(args.items):
            if [seed, index] in state["done"]:
                continue
            item = make_item("multi_turn", seed, index)
            if any(q.kind == "code" for q in item.questions):
                for row in trace_item(model, processor.tokenizer, item, cache_kwargs, args.policy, args.budget):
                    state["rows"].append({"seed": seed, **row})
                    print(seed, index, row["turn"], row["answer"], repr(row["given"]), flush=True)
            state["done"].append([seed, index])
            path.write_text(json.dumps(state) + "\n")
    full = full_answers(args.full_from)
    for row in state["rows"]:
        key = (row["seed"], row["item"], row["turn"])
        if key in full:
            row["full_correct"] = full[key]
    state["summary"] = summarize(state["rows"])
    path.write_text(json.dumps(state) + "\n")
    header = (f"{args.policy}{' + tiers ' + args.tiers if args.tiers != 'none' else ''} at {args.budget}, gates "
              f"{args.gates}, multi_turn seeds {args.seeds} ({args.items} items each): where the asked code's character "
              "patches are held when the answer's first token is predicted (share of layer x KV-head slots).")
    (out / "trace.md").write_text(to_markdown(state["summary"], state["rows"], header))
    print((out / "trace.md").read_text())


if __name__ == "__main__":
    main()
