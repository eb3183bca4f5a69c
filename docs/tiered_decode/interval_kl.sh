#!/usr/bin/env bash
# KL of dbtrimkv + tiers (the shipped gates, bf16) routing every 8 decode steps (the window, QEvict's
# interval and the default) against every 16, on the four pg84 passages of the tier tables
# (2048-token context, 128 continuation tokens, budgets 0.05 / 0.1 / 0.25). Resumable.
# Appends to docs/tiered_decode/interval_kl_pg84.jsonl.
# Session 24: INTERVALS="32 64" BUDGETS="0.05 0.1" SUFFIX=-s24 adds every-32 and every-64 cells and
# reruns every 8 beside them under labels ending in SUFFIX (the CPU decode kernel changed since the
# rows without a suffix).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=PASSIVE
cells=""
for b in ${BUDGETS:-0.05 0.1 0.25}; do
  cells="$cells --cell every8${SUFFIX:-}:dbtrimkv:$b:tiers=int2"
  for w in ${INTERVALS:-16}; do cells="$cells --cell every$w${SUFFIX:-}:dbtrimkv:$b:tiers=int2,evict_every=$w"; done
done
for off in ${OFFSETS:-100000 175000 250000 325000}; do
  python -m vlm_kv.eval.gate_cells --model smollm2 --dtype bfloat16 --text ../shared/data/text/pg84.txt \
    --offset $off --context 2048 --continuation 128 --out docs/tiered_decode/interval_kl_pg84.jsonl $cells
done
