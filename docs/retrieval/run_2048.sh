#!/bin/bash
# Issue 26's remaining retrieval cells: 2048-token haystacks (pg84 from 100000, depths 0.1 / 0.5 / 0.9,
# 8 trials a depth) for the shipped v4 gates and the baselines, and untiered bf16 at 1024 tokens.
# The v4 gates are named with --gates so that scripts/retrieval_table.py labels them. Resumable
# (finished cells are skipped); one thread. Most important first: later-turn questions.
set -euo pipefail
cd "$(dirname "$0")/../.."
T=../shared/data/text/pg84.txt
G=docs/retrieval/gates/facts-aw05
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
C="--task retrieval --model smollm2 --text $T --offset 100000 --depths 0.1,0.5,0.9 --trials 8 --no-progress --budgets 0.05,0.1,0.25"
for ask in later prompt; do
  vlm-kv sweep $C --context 2048 --ask $ask --dtype bfloat16 --tiers int2 --policies dbtrimkv --gates $G \
      --out docs/retrieval/ctx2048/gates_facts-aw05/bf16_tiered_$ask
  vlm-kv sweep $C --context 2048 --ask $ask --policies dbtrimkv --gates $G --out docs/retrieval/ctx2048/gates_facts-aw05/fp32_$ask
  vlm-kv sweep $C --context 2048 --ask $ask --policies kvzip,snapkv,h2o --out docs/retrieval/ctx2048/fp32_$ask
  vlm-kv sweep $C --context 2048 --ask $ask --dtype bfloat16 --tiers int2 --policies snapkv \
      --out docs/retrieval/ctx2048/bf16_tiered_$ask
  vlm-kv sweep $C --context 1024 --ask $ask --dtype bfloat16 --policies dbtrimkv --gates $G \
      --out docs/retrieval/gates_facts-aw05/bf16_$ask
done
