#!/bin/bash
# Long decoding (issue 25, "also measure"): KL along a 1024-token continuation per 128-token block,
# and how many demoted INT2 windows come back (QEvict's recoverability claim). SmolLM2-135M-Instruct,
# pg84 at offset 100000, 2048-token prompt, budget 0.1, fp32. Resumable: a finished cache is skipped.
# Then: python scripts/plot_kl_blocks.py docs/long_decoding/runs.jsonl --out docs/long_decoding/kl_blocks.png
# (run.sh's first row, 2026-12-03 on the v3 gates, is kept in runs_2026-12-03_v3_gates.jsonl)
set -euo pipefail
cd "$(dirname "$0")/../.."
# CONTINUATION=2048 writes runs_2048.jsonl (the labels are the same)
out=docs/long_decoding/runs${CONTINUATION:+_$CONTINUATION}.jsonl
touch $out
C="--model smollm2 --text ../shared/data/text/pg84.txt --offset 100000 --context 2048 --continuation ${CONTINUATION:-1024} --budget 0.1 --json"
run() {  # label, flags
  grep -q "\"label\": \"$1\"" $out && return
  line=$(vlm-kv fidelity $C $2 2>/dev/null | tail -1)
  python -c "import json,sys; r=json.loads(sys.argv[1]); r['label']=sys.argv[2]; print(json.dumps(r))" "$line" "$1" >> $out
}
run dbtrimkv_tiers "--policy dbtrimkv --tiers int2"
run qevict "--policy qevict"
run dbtrimkv "--policy dbtrimkv"
run snapkv "--policy snapkv"
run h2o "--policy h2o"
