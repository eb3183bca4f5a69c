#!/usr/bin/env bash
# Choosing among gate sets (issue 26) on a validation passage, never on the reported one:
# pg84 from character 300000 (the tables use 100000), fact seed 1. Later-turn questions,
# untiered fp32 and tiered bf16. Usage: val_gates.sh NAME GATES_DIR; resumable per cell.
# CONTEXT=2048 (session 23): the same cells on 2048-token haystacks, in docs/retrieval/val/ctx2048/.
set -euo pipefail
cd "$(dirname "$0")/../.."
name=$1; gates=$2
ctx=${CONTEXT:-1024}
out=docs/retrieval/val/$name
if [ "$ctx" != 1024 ]; then out=docs/retrieval/val/ctx$ctx/$name; fi
C="--task retrieval --model smollm2 --text ../shared/data/text/pg84.txt --offset 300000 --seed 1 --context $ctx
   --depths 0.1,0.5,0.9 --trials 8 --ask later --policies dbtrimkv --gates $gates --no-progress"
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
vlm-kv sweep $C --budgets 0.05,0.1,0.25 --out $out/fp32
vlm-kv sweep $C --budgets 0.05,0.1 --dtype bfloat16 --tiers int2 --out $out/bf16_tiered
