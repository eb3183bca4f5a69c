#!/usr/bin/env bash
# One of the multimodal benchmark's tables on smollava (issue 22): TASK (single, multi_image or
# multi_turn) over ITEMS held-out items (data seed 1), every policy at 0.05 / 0.1 / 0.25 of the
# whole cache, answers generated greedily on the compressed cache. One thread; rerun to resume.
# dbtrimkv takes smollava's shipped gates; kvzip is not in the list (an image cannot be read back
# as text, the sweep refuses it). Cache settings that are not a policy (--tiers int2, --strategy,
# --allocation-kwargs) go to a folder of their own; --reference-dir DIR shares the full cache's
# pass between folders. sweep_single.sh and sweep_multi_turn.sh set TASK and ITEMS. MODEL=smollava:FOLDER
# measures candidate trained parts (a `train-vlm --export` folder) instead of the shipped ones.
# Arguments come after the defaults here and win: `--data-seed 2` sweeps the second held-out set
# (session 32; give it a --reference-dir of its own).
set -euo pipefail
cd "$(dirname "$0")/../.."
TASK=${TASK:?set TASK to single, multi_image or multi_turn}
ITEMS=${ITEMS:?set ITEMS}
OUT=${OUT:-runs/mm_$TASK}
POLICIES=${POLICIES:-snapkv,h2o,streaming_llm,fastv,visionzip,tova,pyramidkv,adakv,rkv,qevict,dbtrimkv}
OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE vlm-kv sweep --task multimodal --model "${MODEL:-smollava}" --data-seed 1 \
  --items "$ITEMS" --tasks "$TASK" --policies "$POLICIES" --budgets 0.05,0.1,0.25 --device cpu \
  --out "$OUT" --no-progress "$@"
