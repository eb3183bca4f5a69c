#!/usr/bin/env bash
# Kernel checks for a machine with a CUDA GPU, in one go:
#   1. tests/kernels compiled for CUDA (not interpreted): Triton decode kernels and flash-attn
#      varlen prefill (when flash_attn imports) against the PyTorch reference;
#   2. the AOT compile table's runtime counterpart: the decode kernel variants launched for real,
#      with the registers / spills / shared memory the driver reports beside the ahead-of-time
#      numbers of docs/kernels/compile_sm80_sm90.json (scripts/kernel_compile_table.py --runtime);
#   3. the decode micro-benchmark: torch vs triton ms per call at several row lengths, and the
#      Triton kernel's K/V bandwidth as a fraction of the device's measured copy bandwidth;
#   4. throughput of a 7B-class model with random weights (Qwen2.5-VL-7B's language model, bf16):
#      prefill and decode tokens/s and peak memory, DynamicCache + SDPA vs vlm_kv caches
#      (scripts/gpu_throughput.py; one JSON line per run).
# Usage: scripts/gpu_check.sh [output folder]   (default: $OUT if set, else runs/gpu_check)
# Env: PYTHON (default python3), LENGTHS (default 1024,4096,16384,65536), BENCH_ARGS (extra flags),
#      RUNTIME_TABLE_ARGS (default: bf16 and fp32 variants of GQA groups 7 and 3, ~30 compiles),
#      THROUGHPUT_ARGS (extra flags for gpu_throughput.py, e.g. "--lengths 8192 --batches 1").
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUTDIR="${1:-${OUT:-runs/gpu_check}}"
LENGTHS="${LENGTHS:-1024,4096,16384,65536}"
mkdir -p "$OUTDIR"
unset TRITON_INTERPRET  # compile the kernels for the GPU

"$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "gpu_check.sh needs a CUDA device"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
import triton
print("triton", triton.__version__)
try:
    import flash_attn
    print("flash_attn", flash_attn.__version__)
except Exception as exc:
    print("flash_attn not importable:", exc)
PY

if ! "$PY" -c "import vlm_kv.kernels" 2>/dev/null; then
  echo "vlm_kv.kernels not importable: installing this checkout (editable, no deps)"
  "$PY" -m pip install --no-deps --no-build-isolation -q -e .
fi

echo "== tests/kernels on CUDA"
OMP_NUM_THREADS=4 "$PY" -m pytest -q -p no:cacheprovider -rs tests/kernels 2>&1 | tee "$OUTDIR/tests.txt"

echo "== AOT compile table vs the driver (kernel variants launched on this GPU)"
"$PY" scripts/kernel_compile_table.py --runtime ${RUNTIME_TABLE_ARGS:---dtypes bfloat16,float32 --groups 7,3} \
  --json "$OUTDIR/runtime_resources.json" 2>&1 | tee "$OUTDIR/runtime_resources.txt" || true

echo "== decode micro-benchmark"
for dtype in bfloat16 float32; do
  "$PY" -m vlm_kv.kernels.bench_kernels --device cuda --dtype "$dtype" --lengths "$LENGTHS" \
    --json "$OUTDIR/kernel_bench_${dtype}.jsonl" ${BENCH_ARGS:-} 2>&1 | tee "$OUTDIR/bench_${dtype}.txt"
done
echo "== throughput: 7B-class model (random weights), DynamicCache vs vlm_kv caches"
"$PY" scripts/gpu_throughput.py --json "$OUTDIR/throughput.jsonl" ${THROUGHPUT_ARGS:-} 2>&1 \
  | tee "$OUTDIR/throughput.txt" || true
echo "results in $OUTDIR"
