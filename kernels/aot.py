"""Ahead-of-time compilation of every Triton kernel variant the runtime launches, for named GPUs, without a GPU.

Triton compiles for a ``GPUTarget`` it is told about (its wheel ships ``ptxas``), so a CPU machine
can produce the PTX and cubin of each variant and read what the GPU would see: registers per
thread, register spills and shared memory per block.

Which variants: the census (``vlm_kv.eval.kernel_census``, a layer above the runtime it drives) does
not list constexpr combinations by hand. It runs the
runtime's own launch code on small CPU tensors (the cache's decode paths through real
``VarlenKVStore`` / ``Int2Tier`` objects, and the public kernels API) with every Triton kernel of
``paged_triton`` replaced by a recorder, and turns each recorded launch into its compile key the
way Triton's launcher does (pointer dtypes, 16-byte alignment, integers equal to 1 folded into
constants, constexprs, ``num_warps``). Block sizes, tiles, window sizes, query dtypes and
precision therefore come from the launch code and its defaults; what the census chooses is the
matrix around it: model dtypes x head_dim x GQA group (``MODEL_SHAPES``), INT2 or not, key grid,
basis, holes. Integer arguments (table widths) take generic values (neither 1 nor a multiple of
16) except where the runtime always passes 1; Triton compiles those integer classes separately
at run time, with the same tiles.

How: each variant compiles in a fresh Python process started with TRITON_INTERPRET=0
(``compile_jobs`` says why), always recompiled into a throw-away cache; registers and spills come
from ``ptxas -v``, shared memory from the compiled kernel's metadata. On a GPU, the census'
``runtime_records`` launches the same variants for real and reads what the driver reports.

``varlen_prefill.py`` has no Triton kernel (its CUDA path is flash-attn's), so every variant is
of ``paged_triton``'s split decode kernel or its merge kernel.

    records = compile_variants(kernel_census.census(TARGETS["sm_90"]), [TARGETS["sm_90"]], workers=2)
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

KERNEL_MODULE = "vlm_kv.kernels.paged_triton"
WARP_SIZE = 32  # every NVIDIA target


@dataclass(frozen=True)
class TargetSpec:
    """A GPU to compile for, with the two device facts a compile cannot read off a GPU it lacks:
    the multiprocessor count (the launcher sizes its split count by it) and the most shared memory
    a block may opt into (what ``cudaDevAttrMaxSharedMemoryPerBlockOptin`` reports)."""

    name: str
    arch: int
    device: str
    multiprocessors: int
    max_shared_bytes: int


TARGETS: dict[str, TargetSpec] = {
    "sm_80": TargetSpec("sm_80", 80, "A100", 108, 166912),    # 163 KiB
    "sm_90": TargetSpec("sm_90", 90, "H100 SXM", 132, 232448),  # 227 KiB (H200: same SM)
}


@dataclass(frozen=True)
class ModelShape:
    """Attention heads of a supported model family (published configs)."""

    name: str
    num_query_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.num_query_heads // self.num_kv_heads


MODEL_SHAPES = (
    ModelShape("SmolLM2-135M", 9, 3, 64),
    ModelShape("SmolLM2-1.7B", 32, 32, 64),
    ModelShape("Llama-3.1-8B", 32, 8, 128),
    ModelShape("Qwen2.5-VL-7B", 28, 4, 128),
    ModelShape("Qwen2.5-VL-3B", 16, 2, 128),
)
# a context long enough that the split count is set by the device, not by the row's tiles
LONG_CONTEXT = 1 << 17


@dataclass(frozen=True)
class DecodeShape:
    """One (head_dim, GQA group) cell of the matrix; ``num_kv_heads`` is the fewest kv heads of a
    family with that group, which gives the launcher's largest split count (batch 1)."""

    head_dim: int
    group: int
    num_kv_heads: int


def decode_shapes(families: tuple[ModelShape, ...] = MODEL_SHAPES) -> list[DecodeShape]:
    """Every head_dim crossed with every GQA group of ``families`` (a kernel is compiled per cell)."""
    groups = sorted({f.group for f in families})
    dims = sorted({f.head_dim for f in families})
    fewest = {g: min(f.num_kv_heads for f in families if f.group == g) for g in groups}
    return [DecodeShape(d, g, fewest[g]) for d in dims for g in groups]


@dataclass
class Variant:
    """One compile key of one kernel: what ``triton.compile`` needs, plus where the runtime launches it."""

    kernel: str
    signature: dict[str, str]
    constexprs: dict[str, Any]
    aligned: tuple[str, ...]  # arguments Triton specializes as 16-byte aligned / divisible by 16
    options: dict[str, Any]   # launch options (num_warps, num_stages) the launcher passed
    params: dict[str, Any]    # what the table shows: model dtype, head_dim, group, tier, ...
    paths: list[str] = field(default_factory=list)  # runtime paths that launch this variant
    module: str = KERNEL_MODULE

    def key(self) -> tuple:
        return (self.module, self.kernel, tuple(self.signature.items()), tuple(sorted(self.constexprs.items())),
                self.aligned, tuple(sorted(self.options.items())))


@dataclass
class CompileRecord:
    """The outcome of compiling one variant for one target."""

    kernel: str
    params: dict[str, Any]
    target: str
    ok: bool
    n_regs: int | None = None
    n_spills: int | None = None        # spilled 32-bit registers: ptxas's spill stores / 4
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    stack_bytes: int | None = None
    shared_bytes: int | None = None    # dynamic shared memory per block (Triton's metadata.shared)
    max_shared_bytes: int | None = None
    seconds: float = 0.0
    error: str = ""
    paths: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        """Why this variant would fail or be slow on the target: not compiled, spills, too much shared memory."""
        if not self.ok:
            return [f"does not compile: {self.error}"]
        out = []
        if self.n_spills or self.spill_store_bytes or self.spill_load_bytes:
            out.append(f"spills registers ({self.spill_store_bytes} B stores, {self.spill_load_bytes} B loads)")
        if None not in (self.shared_bytes, self.max_shared_bytes) and self.shared_bytes > self.max_shared_bytes:
            out.append(f"needs {self.shared_bytes} B shared memory, the target has {self.max_shared_bytes}")
        return out

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------------------------- census
@dataclass
class _Launch:
    kernel: Any  # the module's jitted object (JITFunction, or InterpretedFunction under TRITON_INTERPRET=1)
    name: str
    args: tuple
    kwargs: dict[str, Any]
    compiled: Any = None  # the CompiledKernel, when the launch really ran


class _Recorder:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **kwargs)`` records the launch and, with
    ``run``, launches the real kernel too (keeping the compiled kernel Triton returns)."""

    def __init__(self, kernel: Any, name: str, sink: list[_Launch], run: bool) -> None:
        self.kernel, self.name, self.sink, self.run = kernel, name, sink, run

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            compiled = self.kernel[grid](*args, **kwargs) if self.run else None
            self.sink.append(_Launch(self.kernel, self.name, args, kwargs, compiled))

        return launch


def _is_jitted(value: Any) -> bool:
    # lazy: triton is optional (the dev / gpu extras)
    from triton.runtime.interpreter import InterpretedFunction

    # lazy: triton is optional (the dev / gpu extras)
    from triton.runtime.jit import JITFunction

    return isinstance(value, (JITFunction, InterpretedFunction))


@contextlib.contextmanager
def recorded_launches(run: bool = False) -> Iterator[list[_Launch]]:
    """Within: every jitted kernel of ``paged_triton`` records its launches. Without ``run`` nothing
    is launched and the launcher accepts CPU tensors (its CUDA check reads ``INTERPRETED``); with
    ``run`` (on a GPU) every launch also runs. Restored on exit."""
    module = importlib.import_module(KERNEL_MODULE)
    launches: list[_Launch] = []
    saved = {name: value for name, value in vars(module).items() if _is_jitted(value)}
    saved_interpreted = module.INTERPRETED
    try:
        for name, value in saved.items():
            setattr(module, name, _Recorder(value, name, launches, run))
        module.INTERPRETED = saved_interpreted or not run
        yield launches
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
        module.INTERPRETED = saved_interpreted


def kernel_params(kernel: Any) -> list[Any]:
    """The parameters of a jitted kernel as Triton's launcher reads them (``KernelParam``: name, constexpr
    or not, specialization flags), for a ``JITFunction`` or an ``InterpretedFunction`` alike."""

    # lazy: triton is optional (the dev / gpu extras)
    from triton.runtime.jit import KernelParam

    params = getattr(kernel, "params", None)
    if params is not None:  # JITFunction
        return params
    # an InterpretedFunction (TRITON_INTERPRET=1) keeps only the function and its decoration options
    options = getattr(kernel, "kwargs", {})
    dns = options.get("do_not_specialize") or ()
    dns_oa = options.get("do_not_specialize_on_alignment") or ()
    return [KernelParam(i, p, i in dns or p.name in dns, i in dns_oa or p.name in dns_oa)
            for i, p in enumerate(inspect.signature(kernel.fn).parameters.values())]


def specialize(launch: _Launch) -> tuple[dict[str, str], dict[str, Any], tuple[str, ...], dict[str, Any]]:
    """(signature, constexprs, aligned args, options) of a recorded launch, as Triton's launcher
    would derive them: pointer type and 16-byte alignment of tensors, i32/i64 of integers with
    divisibility by 16, integers equal to 1 folded into constants, floats unspecialized."""

    # lazy: triton is optional (the dev / gpu extras)
    from triton._C.libtriton import native_specialize_impl

    # lazy: triton is optional (the dev / gpu extras)
    from triton.backends.compiler import BaseBackend

    params = kernel_params(launch.kernel)
    names = [p.name for p in params]
    arguments = {k: v for k, v in launch.kwargs.items() if k in names}
    bound = inspect.signature(launch.kernel.fn).bind_partial(*launch.args, **arguments)
    options = {k: v for k, v in launch.kwargs.items() if k not in names}
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    aligned: list[str] = []
    for p in params:
        value = bound.arguments[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", value
            continue
        kind, spec = native_specialize_impl(BaseBackend, value, p.is_const, not p.do_not_specialize,
                                            not p.do_not_specialize_on_alignment)
        if kind == "constexpr":
            signature[p.name], constexprs[p.name] = "constexpr", spec
            continue
        signature[p.name] = kind
        if isinstance(spec, str) and "D" in spec:
            aligned.append(p.name)
    return signature, constexprs, tuple(aligned), options


def kernel_source_digest() -> str:
    """sha256 of the source of every jitted function of ``paged_triton``: what a compile table was made from."""

    module = importlib.import_module(KERNEL_MODULE)
    digest = hashlib.sha256()
    for name, value in sorted(vars(module).items()):
        if _is_jitted(value):
            digest.update(name.encode() + b"\0" + inspect.getsource(value.fn).encode() + b"\0")
    return digest.hexdigest()


def dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def variant_params(launch: _Launch, signature: dict[str, str], constexprs: dict[str, Any], options: dict[str, Any],
                    model: dict[str, Any]) -> dict[str, Any]:
    """The columns of the table: the model cell, then the kernel's own choices read off the launch."""
    params = dict(model)
    if launch.name == "_decode_kernel":
        params.update(
            query=signature["q_ptr"][1:], block=constexprs["BS"], tile=constexprs["TILE"],
            int2=bool(constexprs["HAS_INT2"]), holes=bool(constexprs["HAS_HOLES"]), precision=constexprs["PRECISION"],
            window=constexprs["W"] if constexprs["HAS_INT2"] else None,
            key_grid=signature["ks_ptr"][1:] if constexprs["HAS_INT2"] else None,
        )
    else:
        params.update(splits_pad=constexprs["S_PAD"])
    params["num_warps"] = options.get("num_warps", 4)  # Triton's default when the launcher passes none
    return params


# --------------------------------------------------------------------------------------------- compile
_PTXAS_USAGE = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas_log(log: str) -> dict[str, int]:
    """Registers, stack frame and spill bytes of the (single) kernel in a ``ptxas -v`` log."""
    regs, spills = _PTXAS_USAGE.findall(log), _PTXAS_SPILLS.findall(log)
    if len(regs) != 1 or len(spills) != 1:
        raise ValueError(f"expected one kernel's resource usage in the ptxas log, got:\n{log}")
    stack, stores, loads = (int(x) for x in spills[0])
    return {"n_regs": int(regs[0]), "stack_bytes": stack, "spill_store_bytes": stores, "spill_load_bytes": loads}


@contextlib.contextmanager
def _fresh_compile_knobs() -> Iterator[None]:
    """Compile every time into a throw-away cache (nothing is reused across runs, and ptxas always runs so
    its log is there to read), with ptxas's ``-v`` log printed; knobs restored on exit."""
    # lazy: triton is optional (the dev / gpu extras)
    from triton import knobs

    with tempfile.TemporaryDirectory(prefix="vlm_kv_aot_") as cache_dir, \
            knobs.cache.scope(), knobs.compilation.scope(), knobs.nvidia.scope():
        knobs.cache.dir = cache_dir
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True
        with warnings.catch_warnings():
            # the FP-fusion default will change in Triton 3.10; the runtime compiles with today's default
            warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
            yield


def compile_variant(variant: Variant, target: TargetSpec) -> CompileRecord:
    """Compile one variant for one target in this process (no GPU needed); errors become a record with
    ``ok=False``. Needs a process where triton was imported with TRITON_INTERPRET off (see
    ``compile_variants``, which runs this in such processes)."""
    # lazy: triton is optional (the dev / gpu extras)
    import triton

    # lazy: triton is optional (the dev / gpu extras)
    from triton.backends.compiler import GPUTarget

    # lazy: triton is optional (the dev / gpu extras)
    from triton.compiler import ASTSource

    # lazy: triton is optional (the dev / gpu extras)
    from triton.runtime.jit import JITFunction

    record = CompileRecord(variant.kernel, dict(variant.params), target.name, ok=False,
                           max_shared_bytes=target.max_shared_bytes, paths=list(variant.paths))
    start = time.perf_counter()
    try:
        fn = getattr(importlib.import_module(variant.module), variant.kernel)
        if not isinstance(fn, JITFunction):
            raise RuntimeError(f"{variant.kernel} is a {type(fn).__name__}: this process imported triton with "
                               "TRITON_INTERPRET=1, compile through compile_variants instead")
        index = {p.name: p.num for p in fn.params}
        attrs = {(index[name],): [["tt.divisibility", 16]] for name in variant.aligned}
        log = io.StringIO()
        with _fresh_compile_knobs(), contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(fn, dict(variant.signature), dict(variant.constexprs), attrs),
                                      target=GPUTarget("cuda", target.arch, WARP_SIZE), options=dict(variant.options))
        usage = parse_ptxas_log(log.getvalue())
        record.n_regs = usage["n_regs"]
        record.stack_bytes = usage["stack_bytes"]
        record.spill_store_bytes = usage["spill_store_bytes"]
        record.spill_load_bytes = usage["spill_load_bytes"]
        record.n_spills = usage["spill_store_bytes"] // 4
        record.shared_bytes = int(compiled.metadata.shared)
        record.ok = "cubin" in compiled.asm
        if not record.ok:
            record.error = "no cubin produced"
    except Exception as exc:  # a compile error of one variant is a result, reported with the others
        record.error = f"{type(exc).__name__}: {exc}"[:4000]
    record.seconds = round(time.perf_counter() - start, 2)
    return record


def _cost(job: tuple[Variant, TargetSpec]) -> int:
    """Rough relative compile time (INT2 variants and wide heads take longest), to spread work evenly."""
    params = job[0].params
    return (3 if params.get("int2") else 1) * params.get("head_dim", 64)


def compile_variants(variants: list[Variant], targets: list[TargetSpec], workers: int = 2) -> list[CompileRecord]:
    """Compile every variant for every target (``compile_jobs``); records in (target, variant) order."""
    return compile_jobs([(v, t) for t in targets for v in variants], workers)


def compile_jobs(jobs: list[tuple[Variant, TargetSpec]], workers: int = 2) -> list[CompileRecord]:
    """Compile each (variant, target) in ``workers`` fresh Python processes; one record per job, in order.

    Why other processes: Triton fixes interpreted vs compiled when a function is decorated, and that
    includes its own standard library (``tl.max``, ``tl.sum``, ``tl.cdiv`` are ``@jit`` functions of
    ``triton.language.standard``). In a process that imported triton with TRITON_INTERPRET=1 (the
    test suite without a GPU) they are interpreter objects the code generator cannot inline, so
    re-decorating our kernels would not be enough. A worker started with TRITON_INTERPRET=0 in its
    environment compiles exactly as the runtime on a GPU machine would. Jobs are dealt by cost so
    the workers finish together."""

    order = sorted(range(len(jobs)), key=lambda i: -_cost(jobs[i]))
    shares = [order[k::max(1, workers)] for k in range(max(1, workers))]
    env = dict(os.environ, TRITON_INTERPRET="0")
    results: dict[int, CompileRecord] = {}
    with tempfile.TemporaryDirectory(prefix="vlm_kv_aot_jobs_") as tmp:
        running = []
        for k, share in enumerate(s for s in shares if s):
            path_in, path_out = os.path.join(tmp, f"jobs{k}.json"), os.path.join(tmp, f"records{k}.json")
            with open(path_in, "w") as fh:
                json.dump([{"index": i, "variant": asdict(jobs[i][0]), "target": asdict(jobs[i][1])} for i in share], fh)
            proc = subprocess.Popen([sys.executable, "-m", "vlm_kv.kernels.aot", path_in, path_out], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            running.append((proc, share, path_out))
        for proc, share, path_out in running:
            _, stderr = proc.communicate()
            done = {}
            if proc.returncode == 0:
                with open(path_out) as fh:
                    done = {item["index"]: CompileRecord(**item["record"]) for item in json.load(fh)}
            for i in share:
                variant, target = jobs[i]
                results[i] = done.get(i) or CompileRecord(
                    variant.kernel, dict(variant.params), target.name, ok=False, max_shared_bytes=target.max_shared_bytes,
                    paths=list(variant.paths), error=f"compile worker exited with {proc.returncode}: {stderr[-2000:]}")
    return [results[i] for i in range(len(jobs))]


def _worker_main(path_in: str, path_out: str) -> None:
    """A compile worker: read jobs (JSON), compile each in this process, write the records (JSON)."""

    with open(path_in) as fh:
        jobs = json.load(fh)
    records = []
    for job in jobs:
        variant = Variant(**{**job["variant"], "aligned": tuple(job["variant"]["aligned"])})
        records.append({"index": job["index"], "record": compile_variant(variant, TargetSpec(**job["target"])).to_json()})
    with open(path_out, "w") as fh:
        json.dump(records, fh)


__all__ = [
    "MODEL_SHAPES",
    "TARGETS",
    "CompileRecord",
    "DecodeShape",
    "ModelShape",
    "TargetSpec",
    "Variant",
    "LONG_CONTEXT",
    "compile_jobs",
    "compile_variant",
    "compile_variants",
    "decode_shapes",
    "dtype_name",
    "kernel_params",
    "kernel_source_digest",
    "parse_ptxas_log",
    "recorded_launches",
    "specialize",
    "variant_params",
]


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m vlm_kv.kernels.aot JOBS.json RECORDS.json (a compile_variants worker)")
    _worker_main(sys.argv[1], sys.argv[2])
