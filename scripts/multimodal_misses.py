"""Where a compressed cache loses the full cache's answers: the multimodal rows' per-question records
grouped by question kind, turn and the asked image's place in the context.

    python scripts/multimodal_misses.py runs/mm4500/tiered_records runs/mm4500_s2/tiered_records \
        --policy dbtrimkv --budget 0.1 --out docs/smollava/multi_turn_misses

Reads ``sweep_multimodal.json`` rows that carry ``questions`` (sweeps run since session 32) and counts,
per group: questions, the full cache's correct answers, this cache's, ``lost`` (the full cache right,
this cache wrong) and ``gained`` (the other way round). Writes ``misses.md`` and ``misses.json`` (the
counts and every lost question with the answer given).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def records(folders: list[str], policy: str, budget: float, task: str) -> list[dict]:
    out = []
    for folder in folders:
        state = json.loads((Path(folder) / "sweep_multimodal.json").read_text())
        seed = state["settings"]["data_seed"]
        rows = [r for r in state["rows"] if r["policy"] == policy and r["task"] == task
                and abs(float(r["budget"]) - budget) < 1e-9 and not r.get("error")]
        if not rows:
            raise SystemExit(f"{folder}: no {policy} row at {budget} for {task}")
        if "questions" not in rows[0]:
            raise SystemExit(f"{folder}: its rows carry no per-question records (swept before session 32)")
        out += [{**q, "seed": seed} for q in rows[0]["questions"]]
    return out


def place(q: dict) -> str:
    """The asked image's place among the item's images: the oldest third, the middle or the newest."""
    third = q["image"] * 3 // q["images"]
    return ("oldest third", "middle third", "newest third")[third]


def group_counts(recs: list[dict], key) -> list[dict]:
    groups: dict[str, dict] = defaultdict(lambda: {"questions": 0, "full": 0, "cache": 0, "lost": 0, "gained": 0})
    for q in recs:
        g = groups[key(q)]
        g["questions"] += 1
        g["full"] += q["full_correct"]
        g["cache"] += q["correct"]
        g["lost"] += q["full_correct"] and not q["correct"]
        g["gained"] += q["correct"] and not q["full_correct"]
    return [{"group": k, **v} for k, v in sorted(groups.items())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--policy", default="dbtrimkv")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--task", default="multi_turn")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    recs = records(args.folders, args.policy, args.budget, args.task)
    views = {"kind": lambda q: q["kind"],
             "turn": lambda q: f"turn {q['turn']}" if q["turn"] < 3 else "turns 3+",
             "asked image": place}
    tables = {name: group_counts(recs, key) for name, key in views.items()}
    lost = [q for q in recs if q["full_correct"] and not q["correct"]]
    lines = [f"{args.policy} at {args.budget}, {args.task}, {len(recs)} questions from {', '.join(args.folders)}", ""]
    for name, rows in tables.items():
        lines += [f"| {name} | questions | full cache correct | this cache correct | lost | gained |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['group']} | {r['questions']} | {r['full']} | {r['cache']} | {r['lost']} | {r['gained']} |"
                  for r in rows]
        lines.append("")
    lines += ["| seed | item | turn | image (of) | kind | expected | given |", "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {q['seed']} | {q['item']} | {q['turn']} | {q['image'] + 1} ({q['images']}) | {q['kind']} | "
              f"{q['answer']} | {q.get('given', '').strip()!r} |" for q in lost]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "misses.md").write_text("\n".join(lines) + "\n")
    (out / "misses.json").write_text(json.dumps({"policy": args.policy, "budget": args.budget, "task": args.task,
                                                 "folders": args.folders, "tables": tables, "lost": lost}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
