#!/bin/bash
# Planted-fact retrieval tables (issue 26): SmolLM2-135M-Instruct on pg84 (the gates were trained on
# pg1342), 1024-token haystacks, facts at depths 0.1 / 0.5 / 0.9, 8 trials a depth (24 a cell),
# the question in the prompt or asked later. Resumable: rerunning skips finished cells.
set -euo pipefail
cd "$(dirname "$0")/../.."
T=../shared/data/text/pg84.txt
C="--task retrieval --model smollm2 --text $T --offset 100000 --context 1024 --depths 0.1,0.5,0.9 --trials 8 --no-progress"
for ask in later prompt; do
  vlm-kv sweep $C --ask $ask --policies snapkv,h2o,dbtrimkv --budgets 0.05,0.1,0.25 --out docs/retrieval/fp32_$ask
  vlm-kv sweep $C --ask $ask --dtype bfloat16 --tiers int2 --policies dbtrimkv,snapkv --budgets 0.05,0.1,0.25 \
      --out docs/retrieval/bf16_tiered_$ask
done
