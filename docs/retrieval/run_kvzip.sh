#!/bin/bash
# kvzip (query-agnostic, reconstruction-scored) on the same trials as run.sh, in its own folders
# (its own full-cache reference, equal to run.sh's: same trials, same model).
set -euo pipefail
cd "$(dirname "$0")/../.."
T=../shared/data/text/pg84.txt
C="--task retrieval --model smollm2 --text $T --offset 100000 --context 1024 --depths 0.1,0.5,0.9 --trials 8 --no-progress"
for ask in later prompt; do
  vlm-kv sweep $C --ask $ask --policies kvzip --budgets 0.05,0.1,0.25 --out docs/retrieval/fp32_${ask}_kvzip
done
