"""Resident set after each decoder layer of one prefill (issue 25, docs/tiered_prefill.md):
`python scripts/prefill_layer_rss.py POLICY CONTEXT [trim]` prints, every fifth layer, the resident set
and the kernel's high-water mark above the start (MB), then the prefill's peak. POLICY is a tiered
policy at budget 0.1 (tiers int2) or `full` (DynamicCache); `trim` also trims glibc's heap after
every layer. SmolLM2, fp32, one thread, pg84 as text."""
import gc
import sys

import torch

from vlm_kv import make_cache
from vlm_kv.cli.bench import bench_tokens
from vlm_kv.models.named import load_model
from vlm_kv.storage.host_heap import return_freed_heap

torch.set_num_threads(1)
policy, ctx = sys.argv[1], int(sys.argv[2])
trim_every_layer = len(sys.argv) > 3 and sys.argv[3] == "trim"
model, tok = load_model("smollm2")
ids = bench_tokens(tok, "../shared/data/text/pg84.txt", ctx)


def status_mb(key: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) // 1024 for line in fh if line.startswith(key))


marks = []


def after_layer(index: int):
    def hook(module, args, output):
        if trim_every_layer:
            return_freed_heap()
        marks.append((index, status_mb("VmRSS"), status_mb("VmHWM")))
    return hook


for i, layer in enumerate(model.model.layers):
    layer.register_forward_hook(after_layer(i))
with torch.no_grad():
    cache = None if policy == "full" else make_cache(model, policy=policy, budget=0.1, tiers="int2")
    gc.collect()
    return_freed_heap()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    start = status_mb("VmRSS")
    model(input_ids=ids, **({"cache": cache} if cache is not None else {}), use_cache=True, logits_to_keep=1)
print(policy, ctx, "start", start, "MB; (layer, resident, high-water) above it:",
      [(i, r - start, h - start) for i, r, h in marks[::5]], "peak", status_mb("VmHWM") - start)
