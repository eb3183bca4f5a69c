#!/bin/bash
# qevict (QEvict's own scorer and tiers: cumulative attention, INT2 windows) on the same trials as
# run.sh, in its own folders (issue 25's "also measure" names it with dbtrimkv, snapkv and h2o).
# fp32 as the untiered rows; resumable; one thread.
set -euo pipefail
cd "$(dirname "$0")/../.."
T=../shared/data/text/pg84.txt
C="--task retrieval --model smollm2 --text $T --offset 100000 --context 1024 --depths 0.1,0.5,0.9 --trials 8 --no-progress"
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
for ask in later prompt; do
  vlm-kv sweep $C --ask $ask --policies qevict --budgets 0.05,0.1,0.25 --out docs/retrieval/fp32_${ask}_qevict
done
