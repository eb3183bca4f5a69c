"""The tiered-prefill table of docs/tiered_prefill.md for dbtrimkv + tiers (a global ranking): peak KV
during the prefill and process peak, early routing against routing at the end of the forward, from
the rows `bash docs/tiered_prefill/run_global.sh` writes (each over its own run's DynamicCache row).

    python scripts/global_prefill_table.py
"""
from __future__ import annotations

import json
from pathlib import Path

FOLDER = Path(__file__).resolve().parent.parent / "docs" / "tiered_prefill"


def rows(tag: str) -> dict[int, tuple[dict, dict]]:
    """context -> (full row, dbtrimkv row) of one run."""
    path = FOLDER / f"{tag}.jsonl"
    if not path.is_file():
        return {}
    out: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        out.setdefault(r["context"], {})[r["policy"]] = r
    return {c: (v["full"], v["dbtrimkv"]) for c, v in out.items() if "full" in v and "dbtrimkv" in v}


def main() -> None:
    print("| dtype | chunk | context | peak KV in prefill, at the end (before) | early (now) | process peak, before | now |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for dtype in ("float32", "bfloat16"):
        for chunk in ("", "_chunk1024"):
            before, now = rows(f"global_at_end_{dtype}{chunk}"), rows(f"global_early_{dtype}{chunk}")
            for context in sorted(set(before) & set(now)):
                cells = []
                for full, mine in (before[context], now[context]):
                    kv = mine["peak_kv_bytes_prefill"]
                    cells.append((f"{kv / 2**20:.1f} MiB ({kv / full['peak_kv_bytes_prefill']:.2f}x)",
                                  f"{mine['peak_memory_bytes'] / 2**20:.0f} MiB "
                                  f"({mine['peak_memory_bytes'] / full['peak_memory_bytes']:.2f}x)"))
                print(f"| {dtype} | {chunk[6:] or '-'} | {context} | {cells[0][0]} | {cells[1][0]} | {cells[0][1]} | {cells[1][1]} |")


if __name__ == "__main__":
    main()
