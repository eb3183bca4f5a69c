#!/bin/bash
# Tiered decode speed, paired against DynamicCache in one process (--interleave: each round runs
# every cache once, order rotating), fp32 then bf16, SmolLM2, the embedded letter repeated.
# BASE_SITE: a `pip install --no-deps --target` of the commit to compare with (optional).
# TAG: name of this code's rows (default "after"; "slices" for the second change, see tiered_decode.md).
set -e
cd "$(dirname "$0")/../.."
out=docs/tiered_decode
run() {  # tag, python path prefix, extra flags
  [ -s $out/$1.jsonl ] && return
  PYTHONPATH=$2 python -m vlm_kv.cli.main bench --model smollm2 --contexts ${CONTEXTS:-2048,4096,8192} \
    --policies dbtrimkv --budgets 0.1 --tiers int2 --steps 16 --repeats 3 --interleave --json $3 > $out/$1.jsonl.part
  mv $out/$1.jsonl.part $out/$1.jsonl
}
run ${TAG:-after}_fp32 "" ""
[ -n "$BASE_SITE" ] && run before_fp32 "$BASE_SITE" ""
run ${TAG:-after}_bf16 "" "--dtype bfloat16"
[ -n "$BASE_SITE" ] && run before_bf16 "$BASE_SITE" "--dtype bfloat16"
true
