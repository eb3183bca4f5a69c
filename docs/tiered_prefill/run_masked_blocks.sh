#!/bin/bash
# Process peak of a chunked bf16 prefill (chunks of 1024) with the masked attention's queries in
# blocks (session 26) against the commit before it: fresh process per cell, SmolLM2, the embedded
# letter repeated to length, one thread. BASE_SITE: a `pip install --no-deps --target` of the commit
# before (TAG names its rows). Rows: docs/tiered_prefill/masked_blocks_${TAG}.jsonl
set -e
cd "$(dirname "$0")/../.."
out=docs/tiered_prefill/masked_blocks_${TAG:-after}.jsonl
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
for ctx in ${CONTEXTS:-2048 8192}; do
  for policy in ${POLICIES:-dbtrimkv qevict}; do
    grep -q "\"policy\": \"$policy\".*\"context\": $ctx," $out 2>/dev/null && continue
    PYTHONPATH=${BASE_SITE:-} vlm-kv bench --model smollm2 --contexts $ctx --policies $policy --budgets 0.1 --tiers int2 \
      --dtype bfloat16 --steps 4 --repeats 1 --json --prefill-chunk 1024 | grep '^{' >> $out
  done
done
