#!/usr/bin/env bash
# smollava's PolyKV strategy with modality shares (issue 22), calibrated on its own multi-turn chats
# from the training split (data seed 0; the benchmark uses seed 1): each window is a chat's images,
# captions and first question, the full cache's greedy answer its continuation. 4 images a chat
# (~850 tokens), as the gates were trained on: 8-image windows cost ~40 s a window on a shared core,
# 270 probes x 4 windows would have taken ~12 hours. One thread; rerun to resume (the
# measurements are in strategy.progress.json as they finish). The committed strategy was calibrated on step 3050,
# the weights shipped before session 31: MODEL=smollava:train/checkpoints/smollava-3050 reproduces it.
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=${DATA:-runs/data/smollava_cal_turns}
[ -f "$DATA/data.jsonl" ] || python -m vlm_kv.eval.visual_export --task multi_turn --seed 0 --items 4 --n-images 4 --n-questions 3 --out "$DATA" --no-progress
OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE vlm-kv calibrate --model "${MODEL:-smollava}" --data "$DATA/data.jsonl" --images "$DATA" \
  --budget 0.1 --candidates snapkv,tova --windows 2 --continuation 8 \
  --out docs/smollava/calibration/strategy.json "$@"
