#!/bin/bash
# Routing interval vs decode speed at 8192 tokens (issue 25, session 24): dbtrimkv + tiers at 0.1,
# paired with DynamicCache in one process (--interleave), fp32, one thread (as session 21's rows:
# a one-thread retrieval sweep on the other core), 128 decode steps so that even every-64 routes
# twice inside the timed steps. Rows: docs/tiered_decode/interval_sweep_${TAG}.jsonl, one line per
# cache and interval. BASE_SITE: a `pip install --no-deps --target` of another commit to time
# instead (TAG names its rows).
set -e
cd "$(dirname "$0")/../.."
out=docs/tiered_decode/interval_sweep_${TAG:-fp32_1thread}.jsonl
for w in ${INTERVALS:-8 16 32 64}; do
  grep -q "\"evict_every\": $w}" $out 2>/dev/null && continue
  OMP_NUM_THREADS=${THREADS:-1} PYTHONPATH=${BASE_SITE:-} python -m vlm_kv.cli.main bench --model smollm2 \
    --contexts ${CONTEXTS:-8192} --policies dbtrimkv --budgets 0.1 --tiers int2 --steps 128 \
    --repeats ${REPEATS:-2} --interleave --json --evict-every $w \
    | python -c "import json,sys; [print(json.dumps({**json.loads(l), 'evict_every': $w})) for l in sys.stdin if l.startswith('{')]" >> $out
done
