#!/bin/bash
# dbtrimkv + tiers (a global ranking): peak KV during the prefill with early INT2 for entries that can
# no longer be FP (the default since session 22) against one routing event at the end of the forward
# (--prefill-at-end), fp32 and bf16, unchunked and in chunks of 1024. Fresh process per run, SmolLM2,
# the embedded letter repeated to length, one thread. Rows: docs/tiered_prefill/global_*.jsonl
# Session 23: TAG=hwm MODES=early POLICIES=dbtrimkv,qevict reruns the cells with the process peak
# read from the kernel's high-water mark (vlm_kv.cli.bench.PeakMemory) into global_hwm_*.jsonl.
set -e
cd "$(dirname "$0")/../.."
out=docs/tiered_prefill
ctx=${CONTEXTS:-2048,8192}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
for dtype in float32 bfloat16; do
  for chunk in "" 1024; do
    for mode in ${MODES:-early at_end}; do
      flags=""; [ "$mode" = at_end ] && flags="--prefill-at-end"
      tag=global_${TAG:+${TAG}_}${mode}_${dtype}${chunk:+_chunk$chunk}
      [ -s $out/$tag.jsonl ] && continue
      vlm-kv bench --model smollm2 --contexts $ctx --policies ${POLICIES:-dbtrimkv} --budgets 0.1 --tiers int2 --dtype $dtype \
        --steps 4 --repeats 1 --json $flags ${chunk:+--prefill-chunk $chunk} > $out/$tag.jsonl.part
      mv $out/$tag.jsonl.part $out/$tag.jsonl
    done
  done
done
