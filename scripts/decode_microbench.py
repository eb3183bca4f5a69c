"""Per-call time of vlm_kv.attention.decode.decode_attention on a uniform store: the one-SDPA path for small
stores against the split softmax (SMALL_DECODE_ENTRIES = 0). python scripts/decode_microbench.py"""
import torch, time
torch.set_num_threads(1)
from vlm_kv.attention import decode
from vlm_kv.storage.store import VarlenKVStore
def store_of(n, t):
    s = VarlenKVStore(1, 3, 64, torch.float32, torch.device("cpu"))
    s.append(torch.randn(1,3,n+5,64), torch.randn(1,3,n+5,64), torch.arange(n+5), torch.zeros(1,n+5,dtype=torch.uint8), torch.ones(1,n+5,dtype=torch.bool))
    keep = torch.zeros(1,3,n+5,dtype=torch.bool); keep[..., :n] = True
    s.compact(keep)
    s.append(torch.randn(1,3,t,64), torch.randn(1,3,t,64), torch.arange(n+5,n+5+t), torch.zeros(1,t,dtype=torch.uint8), torch.ones(1,t,dtype=torch.bool))
    return s
q = torch.randn(1, 9, 1, 64)
for n in (51, 200, 500, 819):
    s = store_of(n, 8)
    res = {}
    for small in (100000, 0):
        decode.SMALL_DECODE_ENTRIES = small
        for _ in range(200): decode.decode_attention(q, s, None)
        t = time.perf_counter()
        for _ in range(3000): decode.decode_attention(q, s, None)
        res[small] = (time.perf_counter() - t) / 3000 * 1e6
    print(n, {k: round(v, 1) for k, v in res.items()}, "us per call (first: one SDPA call, second: split softmax)")


def ragged_store_of(lens, t):
    """A ragged store (global / adaptive allocations): per-head lengths ``lens``, then ``t`` new tokens."""
    n = max(lens) + 5
    s = VarlenKVStore(1, 3, 64, torch.float32, torch.device("cpu"))
    s.append(torch.randn(1, 3, n, 64), torch.randn(1, 3, n, 64), torch.arange(n), torch.zeros(1, n, dtype=torch.uint8),
             torch.ones(1, n, dtype=torch.bool))
    keep = torch.zeros(1, 3, n, dtype=torch.bool)
    for head, length in enumerate(lens):
        keep[0, head, :length] = True
    s.compact(keep)
    s.append(torch.randn(1, 3, t, 64), torch.randn(1, 3, t, 64), torch.arange(n, n + t), torch.zeros(1, t, dtype=torch.uint8),
             torch.ones(1, t, dtype=torch.bool))
    return s


for lens in ((30, 51, 72), (100, 150, 200)):
    s = ragged_store_of(lens, 8)
    res = {}
    for small in (100000, 0):
        decode.SMALL_DECODE_ENTRIES = small
        for _ in range(200):
            decode.decode_attention(q, s, None)
        t = time.perf_counter()
        for _ in range(3000):
            decode.decode_attention(q, s, None)
        res[small] = (time.perf_counter() - t) / 3000 * 1e6
    print("ragged", lens, {k: round(v, 1) for k, v in res.items()}, "us per call (one SDPA call, split softmax)")
