#!/bin/bash
# More trials for the contested 2048-token later-turn cells (issue 26): the same haystacks as
# run_2048.sh (pg84 from 100000, depths 0.1 / 0.5 / 0.9, 8 trials a depth) with other planted facts
# (--seed S: other keys, codes and wording), so that each cell pools 48-72 trials instead of 24.
# Order: the shipped gates tiered and untiered, then kvzip (the baseline the untiered gates trail at
# 0.05). Resumable (finished cells are skipped); one thread. Pooled table:
#   python scripts/retrieval_table.py docs/retrieval/ctx2048/pooled --from docs/retrieval/ctx2048 \
#       docs/retrieval/ctx2048/seed1 docs/retrieval/ctx2048/seed2
set -euo pipefail
cd "$(dirname "$0")/../.."
T=../shared/data/text/pg84.txt
G=docs/retrieval/gates/facts-aw05
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
C="--task retrieval --model smollm2 --text $T --offset 100000 --depths 0.1,0.5,0.9 --trials 8 --no-progress
   --context 2048 --ask later"
for S in ${SEEDS:-1 2}; do
  O=docs/retrieval/ctx2048/seed$S
  vlm-kv sweep $C --seed $S --budgets 0.05,0.1,0.25 --dtype bfloat16 --tiers int2 --policies dbtrimkv --gates $G \
      --out $O/gates_facts-aw05/bf16_tiered_later
  vlm-kv sweep $C --seed $S --budgets 0.05,0.1,0.25 --policies dbtrimkv --gates $G --out $O/gates_facts-aw05/fp32_later
done
for S in ${SEEDS:-1 2}; do
  vlm-kv sweep $C --seed $S --budgets ${KVZIP_BUDGETS:-0.05,0.1} --policies kvzip --out docs/retrieval/ctx2048/seed$S/fp32_later
done
