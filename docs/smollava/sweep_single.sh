#!/usr/bin/env bash
# The multimodal benchmark's single-image table on smollava (issue 22): 48 held-out items (data seed
# 1), one image and one question, answered greedily by the model on the compressed cache. One
# thread; rerun to resume. Cache settings that are not a policy (--tiers int2, --strategy) go to a
# folder of their own; --reference-dir DIR shares the full cache's pass between folders.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/mm_single}
POLICIES=${POLICIES:-snapkv,h2o,streaming_llm,fastv,visionzip,tova,pyramidkv,adakv,rkv,qevict,dbtrimkv}
OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE vlm-kv sweep --task multimodal --model smollava --data-seed 1 \
  --items 48 --tasks single --policies "$POLICIES" --budgets 0.05,0.1,0.25 --device cpu \
  --out "$OUT" --no-progress "$@"
