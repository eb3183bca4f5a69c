#!/usr/bin/env bash
# The v3 SmolLM2 gates (shipped until 2026-12-03, the start of the issue-26 fine-tunes) restored
# from git into runs/gates_v3; prints their folder. The package holds only the shipped gates
# (5 MB limit), so older gate sets live in the history.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=runs/gates_v3/gates/pretrained/smollm2-135m-dbtrimkv
if [ ! -f $dir/gates.safetensors ]; then
  mkdir -p runs/gates_v3
  git archive 4330e04 gates/pretrained/smollm2-135m-dbtrimkv | tar -x -C runs/gates_v3
fi
echo $dir
