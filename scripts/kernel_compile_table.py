"""Registers, spills and shared memory of every Triton kernel variant the runtime launches, per GPU target.

Compiles ahead of time (no GPU needed: Triton's wheel ships ptxas) every variant that
``vlm_kv.eval.kernel_census.census`` finds for each target, then prints a markdown summary per target and
kernel, the full per-variant table, and the variants that spill or do not compile; ``--json``
writes every record.

    python scripts/kernel_compile_table.py --json docs/kernels/compile_sm80_sm90.json   # ~10 min on 2 cores
    python scripts/kernel_compile_table.py --targets sm_90 --dtypes bfloat16 --groups 7  # a subset
    python scripts/kernel_compile_table.py --runtime --dtypes bfloat16 --groups 7   # on a GPU: the driver's view

``--runtime`` (a CUDA GPU of one of the targets) launches the same variants for real and prints
the registers, spills (local memory / 4, as Triton reports them) and shared memory the driver
reports, beside the AOT record of each variant.

Exit status 1 when a variant fails to compile, spills registers or needs more shared memory than
its target has.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from typing import Any

from vlm_kv.eval.kernel_census import Matrix, census, runtime_records
from vlm_kv.kernels.aot import TARGETS, CompileRecord, compile_variants, decode_shapes, kernel_source_digest

# columns of the per-variant table, in order (absent ones print as "")
VARIANT_COLUMNS = ("dtype", "head_dim", "group", "query", "block", "tile", "int2", "key_grid", "holes", "window",
                   "precision", "splits_pad", "num_warps")


def summary_table(records: list[CompileRecord]) -> str:
    """Per target and kernel: variants, largest register count, spilling variants, largest shared memory."""
    groups: dict[tuple[str, str], list[CompileRecord]] = defaultdict(list)
    for r in records:
        groups[(r.target, r.kernel)].append(r)
    lines = ["| target | kernel | variants | compiled | max registers | spilling | max shared (KiB) | target shared (KiB) |",
             "|---|---|---|---|---|---|---|---|"]
    for (target, kernel), rs in sorted(groups.items()):
        ok = [r for r in rs if r.ok]
        spilling = sum(1 for r in ok if r.n_spills or r.spill_store_bytes)
        regs = max((r.n_regs for r in ok), default=0)
        shared = max((r.shared_bytes for r in ok), default=0)
        lines.append(f"| {target} | {kernel} | {len(rs)} | {len(ok)} | {regs} | {spilling} | {shared / 1024:.0f} | "
                     f"{rs[0].max_shared_bytes / 1024:.0f} |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def variant_table(records: list[CompileRecord]) -> str:
    """One row per variant and target: the variant's parameters, registers, spill bytes, shared memory."""
    head = ("target", "kernel") + VARIANT_COLUMNS + ("regs", "spill stores (B)", "shared (KiB)", "ok")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        cells = [r.target, r.kernel] + [_cell(r.params.get(c)) for c in VARIANT_COLUMNS]
        shared = "" if r.shared_bytes is None else f"{r.shared_bytes / 1024:.0f}"
        cells += [_cell(r.n_regs), _cell(r.spill_store_bytes), shared, "yes" if r.ok else "NO"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="sm_80,sm_90", help=f"comma-separated, of {', '.join(TARGETS)}")
    parser.add_argument("--dtypes", default=None, help="model dtypes, comma-separated (default: every float dtype)")
    parser.add_argument("--groups", default=None, help="GQA groups, comma-separated (default: every supported one)")
    parser.add_argument("--workers", type=int, default=2, help="compile processes")
    parser.add_argument("--json", default=None, help="write every record to this file")
    parser.add_argument("--summary-only", action="store_true", help="print the summary and problems, not every variant")
    parser.add_argument("--runtime", action="store_true",
                        help="on a CUDA GPU: launch the variants for real and print what the driver reports, "
                             "beside the AOT records of --aot-json for the GPU's arch")
    parser.add_argument("--aot-json", default="docs/kernels/compile_sm80_sm90.json",
                        help="AOT records to compare with in --runtime mode")
    args = parser.parse_args(argv)
    unknown = [t for t in args.targets.split(",") if t not in TARGETS]
    if unknown:
        parser.error(f"unknown target(s) {unknown}; choose from {list(TARGETS)}")
    return args


def _matrix(args: argparse.Namespace) -> Matrix:
    import torch

    dtypes = tuple(getattr(torch, name) for name in args.dtypes.split(",")) if args.dtypes else None
    shapes = None
    if args.groups:
        groups = {int(g) for g in args.groups.split(",")}
        shapes = tuple(s for s in decode_shapes() if s.group in groups)
    return Matrix(shapes=shapes, dtypes=dtypes)


def _params_key(record: CompileRecord) -> str:
    return json.dumps({k: v for k, v in record.params.items() if k != "splits_pad"}, sort_keys=True)


def runtime_table(records: list[CompileRecord], aot: list[CompileRecord]) -> str:
    """The driver's registers / spills / shared memory per launched variant beside the AOT record of the
    same variant (same parameters; the merge kernel's split padding follows the device)."""
    by_key = {_params_key(r): r for r in aot}
    head = ("kernel",) + VARIANT_COLUMNS + ("regs", "spills", "shared (KiB)", "AOT regs", "AOT spills", "AOT shared (KiB)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        other = by_key.get(_params_key(r))
        cells = [r.kernel] + [_cell(r.params.get(c)) for c in VARIANT_COLUMNS]
        cells += [_cell(r.n_regs), _cell(r.n_spills), f"{r.shared_bytes / 1024:.0f}"]
        cells += [_cell(other.n_regs), _cell(other.n_spills), f"{other.shared_bytes / 1024:.0f}"] if other else ["", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _arch_target() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability()
    name = f"sm_{major}{minor}"
    if name not in TARGETS:
        raise SystemExit(f"this GPU is {name}; the AOT targets are {list(TARGETS)}")
    return name


def _load_records(path: str, target: str) -> list[CompileRecord]:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return []
    return [CompileRecord(**r) for r in data["records"] if r["target"] == target]


def _write_json(path: str, targets: list[str], records: list[CompileRecord]) -> None:
    """The records with what made them (triton version, kernel sources, targets); one record a line."""
    import triton

    head = {"triton": triton.__version__, "kernel_source_sha256": kernel_source_digest(),
            "targets": {n: vars(TARGETS[n]) for n in targets}}
    with open(path, "w") as fh:
        fh.write(json.dumps(head)[:-1] + ', "records": [\n')
        fh.write(",\n".join(json.dumps(r.to_json()) for r in records))
        fh.write("\n]}\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    matrix = _matrix(args)
    start = time.perf_counter()
    if args.runtime:
        target = _arch_target()
        records = runtime_records(TARGETS[target], matrix)
        print(f"## Triton kernels launched on this GPU ({target}): the driver's numbers beside the AOT ones\n")
        print(runtime_table(records, _load_records(args.aot_json, target)) + "\n")
        targets = [target]
    else:
        targets = args.targets.split(",")
        records = []
        for name in targets:
            records += compile_variants(census(TARGETS[name], matrix), [TARGETS[name]], workers=args.workers)
        print(f"## Triton kernels compiled ahead of time ({len(records)} variant x target compiles, "
              f"{time.perf_counter() - start:.0f} s)\n")
        print(summary_table(records) + "\n")
        if not args.summary_only:
            print(variant_table(records) + "\n")
    problems = [(r, p) for r in records for p in r.problems()]
    print(f"problems: {len(problems)}")
    for r, problem in problems:
        print(f"- {r.target} {r.kernel} {json.dumps(r.params)}: {problem}")
    if args.json:
        _write_json(args.json, targets, records)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
