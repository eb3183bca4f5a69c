#!/usr/bin/env bash
# The KL side of issue 26: the pg84 fidelity cells (2048-token context, 128 continuation tokens,
# dbtrimkv + tiers, bf16, budgets 0.05 / 0.1 / 0.25) for the shipped v3 gates (from git, so a changed default cannot move the baseline) and each candidate, in
# one command so before and after run the same way, on the four pg84 passages of docs/tiers.md.
# Usage: kl_check.sh NAME=GATES_DIR ...
# Appends to docs/retrieval/kl_check_pg84.jsonl (finished cells are skipped).
# UNTIERED=1: the same cells untiered in float32, to docs/retrieval/kl_check_pg84_untiered_fp32.jsonl.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
cells=""
for spec in v3=$(bash docs/retrieval/v3_gates.sh) "$@"; do
  name=${spec%%=*}; dir=${spec#*=}
  for b in 0.05 0.1 0.25; do
    if [ -n "${UNTIERED:-}" ]; then cells="$cells --cell $name:dbtrimkv:$b:gates=$dir"
    else cells="$cells --cell $name:dbtrimkv:$b:tiers=int2,gates=$dir"; fi
  done
done
for off in ${OFFSETS:-100000 175000 250000 325000}; do
  if [ -n "${UNTIERED:-}" ]; then dtype=float32 out=docs/retrieval/kl_check_pg84_untiered_fp32.jsonl
  else dtype=bfloat16 out=docs/retrieval/kl_check_pg84.jsonl; fi
  python -m vlm_kv.eval.gate_cells --model smollm2 --dtype $dtype --text ../shared/data/text/pg84.txt \
    --offset $off --context 2048 --continuation 128 --out $out $cells
done
