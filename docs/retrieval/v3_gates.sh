#!/usr/bin/env bash
# The v3 SmolLM2 gates (shipped; the start of the issue-26 fine-tunes) restored from git into
# runs/gates_v3, pinned to a commit, so that a later change of the shipped folder cannot move the
# baseline of the KL check or the fine-tunes' start; prints their folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=runs/gates_v3/gates/pretrained/smollm2-135m-dbtrimkv
if [ ! -f $dir/gates.safetensors ]; then
  mkdir -p runs/gates_v3
  git archive 4330e04 gates/pretrained/smollm2-135m-dbtrimkv | tar -x -C runs/gates_v3
fi
echo $dir
