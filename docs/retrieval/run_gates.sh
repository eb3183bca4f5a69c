#!/usr/bin/env bash
# The reported retrieval cells (run.sh's passage and trials: pg84 from 100000, seed 0) for a
# candidate gate set. Usage: run_gates.sh NAME GATES_DIR; resumable; one thread.
set -euo pipefail
cd "$(dirname "$0")/../.."
name=$1; gates=$2
C="--task retrieval --model smollm2 --text ../shared/data/text/pg84.txt --offset 100000 --context 1024
   --depths 0.1,0.5,0.9 --trials 8 --no-progress --policies dbtrimkv --gates $gates --budgets 0.05,0.1,0.25"
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
for ask in later prompt; do
  vlm-kv sweep $C --ask $ask --out docs/retrieval/gates_$name/fp32_$ask
  vlm-kv sweep $C --ask $ask --dtype bfloat16 --tiers int2 --out docs/retrieval/gates_$name/bf16_tiered_$ask
done
