#!/usr/bin/env bash
# The multimodal benchmark's multi-turn table on smollava (issue 22): 16 held-out chats (data
# seed 1), each 8 captioned images then 4-8 questions about different images, asked one turn at
# a time on the compressed cache and answered by the model (generated, greedy). One thread; rerun
# to resume. Any policies (kivi2 keeps every entry in 2 bits at budget 1.0: its own run); dbtrimkv
# takes smollava's shipped gates by default. Other cache settings (--tiers int2, --allocation-kwargs)
# go to a folder of their own; --reference-dir DIR shares the full cache's pass between folders.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/mm_multi_turn}
POLICIES=${POLICIES:-snapkv,h2o,streaming_llm,fastv,visionzip,tova,pyramidkv,adakv,rkv,qevict,kvzip}
OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE vlm-kv sweep --task multimodal --model smollava --data-seed 1 \
  --items 16 --tasks multi_turn --policies "$POLICIES" --budgets 0.05,0.1,0.25 --device cpu \
  --out "$OUT" --no-progress "$@"
