"""The Triton decode kernels compile for sm_80 and sm_90 without a GPU, without register spills, within shared memory.

``vlm_kv.kernels.aot`` records the launches the runtime makes (cache decode paths and the public
kernels API) and compiles each distinct variant ahead of time with the ptxas that ships with triton.

The whole matrix (both targets, every model dtype, head_dim and GQA group: 780 compiles, about 18
minutes on 2 cores) is ``scripts/kernel_compile_table.py``, whose output docs/kernels/compile_sm80_sm90.json
is checked here against today's kernel sources and census. What compiles here (about 3 minutes on 2
cores): on sm_90 every variant of GQA group 7 (Qwen2.5-VL-7B) over every model dtype, head_dim and
runtime path; on sm_80 the fp32 and bf16 variants of group 8, among them the ones that spilled a few
bytes there before the last launch change. The group changes no tile of the decode kernel (its query
block is padded to 16 rows) but ptxas's register allocation still varies a little with it.
"""
import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from vlm_kv.eval import kernel_census  # noqa: E402
from vlm_kv.kernels import aot  # noqa: E402

SM80, SM90 = aot.TARGETS["sm_80"], aot.TARGETS["sm_90"]
# compile processes: 2 on CI's two cores, more where there are more (the GPU machine has 16)
WORKERS = max(2, min(8, (os.cpu_count() or 2) // 2))
# one decode cell's variants: FP body + tail; INT2 beside the body (channel basis) and INT2 alone with
# the rotated query (Hadamard bases), each with the fp16 or the decoded int8 key grid, with or without
# holes; the public API's paged, mixed and mixed-with-holes launches
DECODE_VARIANTS_PER_CELL = 1 + 2 * 2 * 2 + 3


@pytest.fixture(scope="module")
def sm90_census():
    return kernel_census.census(SM90)


def _pre_fix_probe(variants: list[aot.Variant]) -> aot.Variant:
    """The fp32 INT2 variant at head_dim 128 as first launched (tile 64, Triton's default 4 warps): it spilled."""
    base = next(v for v in variants if v.kernel == "_decode_kernel" and v.params["int2"] and v.params["head_dim"] == 128
                and v.params["dtype"] == "float32" and v.params["block"] == 1)
    return dataclasses.replace(base, constexprs={**base.constexprs, "TILE": 64}, options={"num_warps": 4},
                               params={**base.params, "probe": "tile 64, 4 warps"})


@pytest.fixture(scope="module")
def compiled(sm90_census):
    sm90 = [v for v in sm90_census if v.params["group"] == 7]
    group8 = tuple(s for s in aot.decode_shapes() if s.group == 8)
    sm80 = kernel_census.census(SM80, kernel_census.Matrix(shapes=group8, dtypes=(torch.float32, torch.bfloat16)))
    jobs = [(v, SM90) for v in sm90] + [(_pre_fix_probe(sm90), SM90)] + [(v, SM80) for v in sm80]
    records = aot.compile_jobs(jobs, workers=WORKERS)
    return records[:len(sm90)], records[len(sm90)], records[len(sm90) + 1:]


def test_census_covers_every_dtype_head_dim_group_and_runtime_path(sm90_census):
    from vlm_kv.kernels import paged_triton
    from vlm_kv.kernels.layout import FLOAT_DTYPES

    cells = {(str(dt).replace("torch.", ""), s.head_dim, s.group) for dt in FLOAT_DTYPES for s in aot.decode_shapes()}
    assert {s.group for s in aot.decode_shapes()} == {1, 3, 4, 7, 8} and {s.head_dim for s in aot.decode_shapes()} == {64, 128}
    decode = [v for v in sm90_census if v.kernel == "_decode_kernel"]
    merge = [v for v in sm90_census if v.kernel == "_merge_kernel"]
    assert len(decode) + len(merge) == len(sm90_census)
    for kind in (decode, merge):
        assert {(v.params["dtype"], v.params["head_dim"], v.params["group"]) for v in kind} == cells
    per_cell = {c: [v for v in decode if (v.params["dtype"], v.params["head_dim"], v.params["group"]) == c] for c in cells}
    assert {len(vs) for vs in per_cell.values()} == {DECODE_VARIANTS_PER_CELL}
    assert {v.params["block"] for v in decode} == {1, 16}  # the cache's one-entry blocks, the API's pages
    assert {(v.params["int2"], v.params["holes"]) for v in decode} == {(False, False), (True, False), (True, True)}
    assert {v.params["key_grid"] for v in decode if v.params["int2"]} == {"fp16", "fp32"}
    # rotated (Hadamard) INT2 sources are read with the float32 rotated query, in every model dtype
    assert {v.params["dtype"] for v in decode if v.params["int2"] and v.params["query"] == "fp32"} == {
        "float32", "bfloat16", "float16"}
    # the launcher's tiles: the small one where INT2 windows are unpacked or dots run in fp32
    assert {(v.params["int2"], v.params["precision"], v.params["tile"]) for v in decode} == {
        (False, "tf32", paged_triton.DECODE_TILE), (False, "ieee", paged_triton.DECODE_SMALL_TILE),
        (True, "tf32", paged_triton.DECODE_SMALL_TILE), (True, "ieee", paged_triton.DECODE_SMALL_TILE)}
    assert {v.options["num_warps"] for v in decode} == {paged_triton.DECODE_NUM_WARPS}
    assert {v.options["num_warps"] for v in merge} == {paged_triton.MERGE_NUM_WARPS}
    assert all(v.paths for v in sm90_census)


def test_every_variant_compiles_without_spills_within_shared_memory(compiled):
    sm90, _, sm80 = compiled
    problems = [f"{r.target} {r.kernel} {r.params}: {p}" for r in sm90 + sm80 for p in r.problems()]
    assert not problems, "\n".join(problems)
    assert {r.target for r in sm90} == {"sm_90"} and {r.target for r in sm80} == {"sm_80"}
    assert len(sm90) == 3 * 2 * (DECODE_VARIANTS_PER_CELL + 1) and len(sm80) == 2 * 2 * (DECODE_VARIANTS_PER_CELL + 1)
    for r in sm90 + sm80:
        assert r.ok and 0 < r.n_regs <= 255 and r.n_spills == 0 and r.stack_bytes == 0
        assert 0 < r.shared_bytes <= r.max_shared_bytes


def test_the_check_catches_the_spills_of_the_first_launch_configuration(compiled):
    """Tile 64 over 4 warps (the launcher's first choice) spills at head_dim 128: the check must say so."""
    _, probe, _ = compiled
    assert probe.ok
    assert probe.spill_store_bytes > 0 and probe.n_spills > 0
    assert any("spills registers" in p for p in probe.problems())


def test_ptxas_log_parsing():
    log = ("ptxas info    : Compiling entry function '_decode_kernel' for 'sm_90a'\n"
           "ptxas info    : Function properties for _decode_kernel\n"
           "    928 bytes stack frame, 976 bytes spill stores, 952 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 928 bytes cumulative stack size\n")
    assert aot.parse_ptxas_log(log) == {"n_regs": 255, "stack_bytes": 928, "spill_store_bytes": 976,
                                        "spill_load_bytes": 952}
    with pytest.raises(ValueError, match="resource usage"):
        aot.parse_ptxas_log("ptxas info    : 11 bytes gmem\n")


def test_record_problems_name_each_failure():
    ok = aot.CompileRecord("k", {}, "sm_90", ok=True, n_regs=100, n_spills=0, spill_store_bytes=0, spill_load_bytes=0,
                           stack_bytes=0, shared_bytes=1000, max_shared_bytes=2000)
    assert ok.problems() == []
    assert "spills" in dataclasses.replace(ok, n_spills=3, spill_store_bytes=12).problems()[0]
    assert "shared memory" in dataclasses.replace(ok, shared_bytes=4000).problems()[0]
    assert "does not compile" in dataclasses.replace(ok, ok=False, error="CompilationError: x").problems()[0]


def test_recorded_launches_restore_the_kernels():
    from vlm_kv.kernels import paged_triton

    before = (paged_triton._decode_kernel, paged_triton._merge_kernel, paged_triton.INTERPRETED)
    with aot.recorded_launches() as launches:
        assert paged_triton._decode_kernel is not before[0]
        assert launches == []
    assert (paged_triton._decode_kernel, paged_triton._merge_kernel, paged_triton.INTERPRETED) == before


def _table_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "kernel_compile_table.py"
    spec = importlib.util.spec_from_file_location("kernel_compile_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_table_matches_the_census_and_shows_no_problem():
    """docs/kernels/compile_sm80_sm90.json (scripts/kernel_compile_table.py) describes today's kernels: made
    from the same kernel sources, the same variants per target as the census finds, every one compiled
    without spills within shared memory."""
    import json
    from pathlib import Path

    table = json.loads((Path(__file__).resolve().parents[2] / "docs" / "kernels" / "compile_sm80_sm90.json").read_text())
    assert table["kernel_source_sha256"] == aot.kernel_source_digest(), \
        "the kernels changed: rerun scripts/kernel_compile_table.py --json docs/kernels/compile_sm80_sm90.json"
    records = [aot.CompileRecord(**r) for r in table["records"]]
    for target in (SM80, SM90):
        want = sorted(json.dumps(v.params, sort_keys=True) for v in kernel_census.census(target))
        got = sorted(json.dumps(r.params, sort_keys=True) for r in records if r.target == target.name)
        assert got == want, f"{target.name}: rerun scripts/kernel_compile_table.py --json docs/kernels/compile_sm80_sm90.json"
    assert not [p for r in records for p in r.problems()]


def test_table_script_summarises_and_matches_runtime_records():
    script = _table_script()
    params = {"dtype": "bfloat16", "head_dim": 128, "group": 7, "int2": True}
    clean = aot.CompileRecord("_decode_kernel", params, "sm_90", ok=True, n_regs=180, n_spills=0, spill_store_bytes=0,
                              spill_load_bytes=0, stack_bytes=0, shared_bytes=40960, max_shared_bytes=232448)
    spilling = dataclasses.replace(clean, params={**params, "head_dim": 64}, n_regs=255, n_spills=46, spill_store_bytes=184)
    summary = script.summary_table([clean, spilling]).splitlines()
    assert summary[2] == "| sm_90 | _decode_kernel | 2 | 2 | 255 | 1 | 40 | 227 |"
    driver = dataclasses.replace(clean, target="sm_90 (driver)", n_regs=178)
    row = script.runtime_table([driver], [clean, spilling]).splitlines()[2]
    assert row.endswith("| 178 | 0 | 40 | 180 | 0 | 40 |")  # the driver's numbers, then the AOT record's
