#!/bin/bash
# qevict's process peak after bounding attention_received's chunks in bytes (session 24): the same
# cells as `TAG=hwm_trim MODES=early POLICIES=dbtrimkv,qevict bash docs/tiered_prefill/run_global.sh`
# (fresh process per cache, one thread, unchunked, 2048 and 8192 tokens), qevict and DynamicCache only.
# Rows: docs/tiered_prefill/qevict_chunk_bytes_{float32,bfloat16}.jsonl
set -e
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
for dtype in float32 bfloat16; do
  out=docs/tiered_prefill/qevict_chunk_bytes_$dtype.jsonl
  [ -s $out ] && continue
  vlm-kv bench --model smollm2 --contexts 2048,8192 --policies qevict --budgets 0.1 --tiers int2 --dtype $dtype \
    --steps 4 --repeats 1 --json > $out.part
  mv $out.part $out
done
