"""vlm_kv.storage.host_heap: memory freed into glibc's heap goes back to the OS."""

import json
import subprocess
import sys

from vlm_kv.storage import host_heap

# In a fresh process (the heap's state in the test process depends on every earlier test), with
# glibc told to serve 8 MiB tensors from its heap and never to trim it by itself (as it does on its
# own once a freed tensor has raised its mmap threshold): freed, they stay resident until trimmed.
_SCRIPT = """
import ctypes, json, torch
from vlm_kv.storage.host_heap import return_freed_heap
libc = ctypes.CDLL("libc.so.6")
libc.mallopt(-3, 64 * 2**20)  # M_MMAP_THRESHOLD
libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
parts = [torch.ones(8 * 2**18) for _ in range(16)]
keep = torch.ones(1024)
held = rss(); del parts; freed = rss()
ok = return_freed_heap()
print(json.dumps({"held": held, "freed": freed, "trimmed": rss(), "ok": ok}))
"""


def test_freed_heap_goes_back_to_the_os():
    out = json.loads(subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                                    check=True).stdout.strip().splitlines()[-1])
    mb = 2**20
    assert out["ok"]
    assert out["held"] - out["freed"] < 32 * mb  # freed, yet still resident
    assert out["freed"] - out["trimmed"] > 96 * mb  # given back


def test_without_malloc_trim_it_says_so(monkeypatch):
    monkeypatch.setattr(host_heap, "_malloc_trim", lambda: None)
    assert host_heap.return_freed_heap() is False
