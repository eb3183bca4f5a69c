"""The multimodal benchmark's table and plots from one or more `vlm-kv sweep --task multimodal` folders.

    python scripts/multimodal_table.py docs/smollava/multi_turn/uniform docs/smollava/multi_turn/tiered:+tiers \
        --task multi_turn --out docs/smollava/multi_turn

Each folder may carry a label suffix (``DIR:+tiers``) appended to its policies' names, for folders
swept with other cache settings (tiers). Folders must hold the same items (model, data seed,
items, tasks, images); their full-cache rows must agree, else the script refuses: the relative
numbers would compare different runs. Writes ``table.md`` (relative accuracy, the share of kept
entries that are visual, answer-token KL and bytes held, per budget), ``rows.json`` (the merged
rows) and three plots: relative accuracy against the budget, accuracy per turn at each budget
(a policy that chooses by the first question may lose what a later turn asks about), and the
share of kept entries that are visual, per layer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ITEM_KEYS = ("model", "data_seed", "items", "tasks", "images", "kinds", "max_new_tokens")


def load(folders: list[str], task: str) -> tuple[list[dict], dict, list[dict]]:
    """(the full cache's row then every policy's, the items' settings, the rows that refused to run)."""
    rows: list[dict] = []
    refused: list[dict] = []
    first_settings = None
    full = None
    for spec in folders:
        folder, _, label = spec.partition(":")
        state = json.loads((Path(folder) / "sweep_multimodal.json").read_text())
        settings = {k: state["settings"].get(k) for k in ITEM_KEYS}
        if first_settings is None:
            first_settings = settings
        elif settings != first_settings:
            raise SystemExit(f"{folder} swept other items: {settings} vs {first_settings}")
        for r in state["rows"]:
            if r["task"] != task:
                continue
            if r.get("error"):
                refused.append({**r, "policy": r["policy"] + label})
                continue
            if r["policy"] == "full":
                if full is not None and abs(full["accuracy"] - r["accuracy"]) > 1e-9:
                    raise SystemExit(f"{folder}: the full cache's accuracy {r['accuracy']} differs from {full['accuracy']}")
                full = full or r
                continue
            rows.append({**r, "policy": r["policy"] + label})
    if full is None:
        raise SystemExit(f"no full-cache row for task {task} in {folders}")
    return [full, *rows], first_settings, refused


def fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict], refused: list[dict] = ()) -> str:
    full, rest = rows[0], rows[1:]
    budgets = sorted({float(r["budget"]) for r in [*rest, *refused]})
    policies = list(dict.fromkeys(r["policy"] for r in [*rest, *refused]))
    cell = {(r["policy"], float(r["budget"])): r for r in [*refused, *rest]}  # a row that ran wins
    head = "| policy | " + " | ".join(f"{b:g}: rel. acc. (visual share, KL, bytes)" for b in budgets) + " |"
    lines = [f"Full cache: accuracy {full['accuracy']:.3f} over {full['items']} items "
             f"({full['full_kv_bytes'] / 2**20:.1f} MiB of KV per item at the end, mean). Bytes below: the most "
             "held after an eviction step, over the full cache's.", "", head,
             "|---|" + "---|" * len(budgets)]
    for p in policies:
        parts = []
        for b in budgets:
            r = cell.get((p, b))
            if r is None:
                parts.append("not run")
                continue
            if r.get("error"):
                parts.append("refused (below)")
                continue
            ratio = r["max_kv_bytes"] / r["full_kv_bytes"] if r.get("full_kv_bytes") else None
            parts.append(f"**{fmt(r['relative_accuracy'], '.3f')}** ({fmt(r.get('visual_share'))}, "
                         f"{fmt(r.get('kl'), '.3f')}, {fmt(ratio)}x)")
        lines.append(f"| {p} | " + " | ".join(parts) + " |")
    ran = {(r["policy"], float(r["budget"])) for r in rest}
    notes = [f"- {r['policy']} at {float(r['budget']):g}: {r['error']}" for r in refused
             if (r["policy"], float(r["budget"])) not in ran]
    if notes:
        lines += ["", "Refused (the policy said why):", *notes]
    return "\n".join(lines) + "\n"


def questions_per_turn(settings: dict, task: str) -> list[int]:
    """How many of the items ask a question at turn k (a chat asks 4-8), from the generator."""
    from vlm_kv.eval.visual_tasks import make_item

    counts: list[int] = []
    for i in range(settings["items"]):
        item = make_item(task, settings["data_seed"], i, images=settings["images"], kinds=tuple(settings["kinds"]))
        for k in range(len(item.questions)):
            counts += [0] * (k + 1 - len(counts))
            counts[k] += 1
    return counts


def turn_table(rows: list[dict], counts: list[int]) -> str:
    """Correct answers at turn 1 (the question the prompt held), turn 2 and turns 3 and later."""
    head = [f"Correct answers by turn (of {counts[0]} at turn 1, {counts[1]} at turn 2, {sum(counts[2:])} at "
            "turns 3 and later): a scorer that chooses by the question in the prompt keeps what turn 1 asks "
            "about and may lose what later turns ask.", "",
            "| policy | budget | turn 1 | turn 2 | turns 3+ | all |", "|---|---|---|---|---|---|"]
    for r in rows:
        hits = [round(a * n) for a, n in zip(r["turn_accuracy"], counts)]
        head.append(f"| {r['policy']} | {float(r['budget']):g} | {hits[0]} | {hits[1]} | {sum(hits[2:])} | {sum(hits)} |")
    return "\n".join(head) + "\n"


def _legend(axes) -> None:
    """One legend beside the last panel for the lines of every panel (a policy may be run at one budget only)."""
    seen: dict = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    axes[-1].legend(list(seen.values()), list(seen), loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)


def plots(rows: list[dict], out: Path, task: str) -> None:
    # lazy: matplotlib is optional (the eval extra)
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib is optional (the eval extra)
    import matplotlib.pyplot as plt

    full, rest = rows[0], rows[1:]
    policies = list(dict.fromkeys(r["policy"] for r in rest))
    cmap = plt.get_cmap("tab20")
    colour = {p: cmap(i % 20) for i, p in enumerate(policies)}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for p in policies:
        pts = sorted((float(r["budget"]), r["relative_accuracy"]) for r in rest if r["policy"] == p)
        ax.plot([b for b, _ in pts], [a for _, a in pts], marker="o", label=p, color=colour[p],
                ls="-" if "dbtrimkv" in p else "--")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set(xscale="log", xlabel="budget (fraction of the full cache)", ylabel="accuracy / full cache's",
           title=f"smollava, {task}: {full['items']} held-out items, full cache {full['accuracy']:.2f}")
    budgets = sorted({float(r["budget"]) for r in rest})
    ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "relative_accuracy.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(budgets), figsize=(4.6 * len(budgets), 3.8), squeeze=False, sharey=True)
    for ax, b in zip(axes[0], budgets):
        turns = full.get("turn_accuracy") or []
        ax.plot(range(1, len(turns) + 1), turns, color="black", lw=2, label="full")
        for p in policies:
            r = next((r for r in rest if r["policy"] == p and float(r["budget"]) == b), None)
            if r and r.get("turn_accuracy"):
                ax.plot(range(1, len(r["turn_accuracy"]) + 1), r["turn_accuracy"], marker=".", color=colour[p],
                        label=p, ls="-" if "dbtrimkv" in p else "--")
        ax.set(title=f"budget {b:g}", xlabel="turn (question number)", ylabel="accuracy")
        ax.grid(alpha=0.3)
    _legend(axes[0])
    fig.tight_layout()
    fig.savefig(out / "accuracy_per_turn.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(budgets), figsize=(4.6 * len(budgets), 3.8), squeeze=False, sharey=True)
    for ax, b in zip(axes[0], budgets):
        for p in policies:
            r = next((r for r in rest if r["policy"] == p and float(r["budget"]) == b), None)
            if r and r.get("visual_share_per_layer"):
                share = r["visual_share_per_layer"]
                ax.plot(range(len(share)), share, marker=".", color=colour[p], label=p,
                        ls="-" if "dbtrimkv" in p else "--")
        ax.set(title=f"budget {b:g}", xlabel="layer", ylabel="share of kept entries that are visual", ylim=(0, 1))
        ax.grid(alpha=0.3)
    _legend(axes[0])
    fig.tight_layout()
    fig.savefig(out / "visual_share_per_layer.png", dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", help="sweep folders, each optionally DIR:label-suffix")
    ap.add_argument("--task", default="multi_turn")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows, settings, refused = load(args.folders, args.task)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(rows, refused)
    if args.task == "multi_turn":
        text += "\n" + turn_table(rows, questions_per_turn(settings, args.task))
    (out / "table.md").write_text(text)
    (out / "rows.json").write_text(json.dumps({"settings": settings, "sources": args.folders, "rows": rows}, indent=1))
    plots(rows, out, args.task)
    print(text)


if __name__ == "__main__":
    main()
