#!/bin/bash
# Peak KV during a tiered prefill, layer by layer (the default) vs one routing event at the end of
# the forward (--prefill-at-end: what every tiered cache did before). Fresh process per run, fp32,
# SmolLM2, the embedded letter repeated to length. Rows: docs/tiered_prefill/*.jsonl
set -e
cd "$(dirname "$0")/../.."
out=docs/tiered_prefill
ctx=${CONTEXTS:-2048,8192}
for chunk in "" 1024; do
  for mode in layerwise at_end; do
    flags=""; [ "$mode" = at_end ] && flags="--prefill-at-end"
    tag=$mode${chunk:+_chunk$chunk}
    [ -s $out/$tag.jsonl ] && continue
    vlm-kv bench --model smollm2 --contexts $ctx --policies snapkv,dbtrimkv,qevict --budgets 0.1 --tiers int2 \
      --steps 4 --repeats 1 --json $flags ${chunk:+--prefill-chunk $chunk} > $out/$tag.jsonl.part
    mv $out/$tag.jsonl.part $out/$tag.jsonl
  done
done
