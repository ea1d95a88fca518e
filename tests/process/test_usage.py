"""memory/peak_rss_gb: the peak resident memory of a run's process tree, children included."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import sys

import pytest

from noria.process.usage import (
    children, memory_metrics, release_free_memory, rss_bytes, status_bytes, tree, tree_peak_rss_bytes,
)

HOLD = 200 * 2**20


def test_the_tree_peak_counts_a_child_that_held_memory_and_drops_it_when_it_exits():
    alone = tree_peak_rss_bytes()
    # The child touches 200 MiB, frees it, says so, then waits: its peak stays, its current RSS falls.
    code = f"b = bytearray({HOLD}); del b; print('ready', flush=True); import sys; sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert child.pid in tree()
        assert status_bytes(child.pid, "VmHWM") >= HOLD
        assert status_bytes(child.pid, "VmRSS") < HOLD
        assert tree_peak_rss_bytes() >= alone + HOLD
        assert memory_metrics()["memory/peak_rss_gb"] * 1e9 >= alone + HOLD
    finally:
        child.stdin.close()
        child.wait()
    assert child.pid not in tree() and tree_peak_rss_bytes() < alone + HOLD


def test_a_gone_process_has_no_children_and_no_memory():
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()  # reaped: its pid names nothing now
    assert children(done.pid) == [] and status_bytes(done.pid, "VmHWM") == 0 and tree_peak_rss_bytes(done.pid) == 0


@pytest.mark.skipif(not ctypes.util.find_library("c"), reason="needs the C library")
def test_free_heap_pages_go_back_to_the_kernel():
    """Memory freed below a live block stays resident in glibc's heap until trimmed: 100 MB of 1 KB
    blocks freed under one kept block; ``release_free_memory`` hands most of it back."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = []
    for _ in range(100_000):
        p = libc.malloc(1024)
        ctypes.memset(p, 1, 1024)  # touched: resident
        blocks.append(p)
    keep = libc.malloc(1024)  # a live block above the freed ones: free() alone cannot shrink the heap
    for p in blocks:
        libc.free(p)
    before = rss_bytes([os.getpid()])
    release_free_memory()
    after = rss_bytes([os.getpid()])
    libc.free(keep)
    assert before - after > 50 << 20, (before >> 20, after >> 20)




_FORWARDS = """
import ctypes, sys, torch
from noria.process.usage import pad_heap_top
if sys.argv[1] == "pad":
    assert pad_heap_top()
class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
x, w1, w2 = torch.randn(1024, 128), torch.randn(128, 512), torch.randn(512, 128)
for _ in range(50):
    y = torch.nn.functional.gelu(x @ w1) @ w2 + x
del y
print(libc.mallinfo2().keepcost)
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(ctypes.util.find_library("c") or None), "mallinfo2"), reason="needs glibc 2.33+")
def test_a_padded_heap_keeps_its_top_after_small_forwards():
    """50 small MLP forwards (2 MB activations, one thread), all freed: with glibc's defaults the free
    top of the heap goes back to the kernel (1.6 MB left there on an EPYC; the next forward faults the
    pages in again, zeroed: 33,000 page faults per 200 forwards); with ``pad_heap_top`` about 59 MB
    stay. ``keepcost`` (the top's releasable bytes) does not depend on what else the machine runs."""
    run = [sys.executable, "-c", _FORWARDS]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread: every allocation in the main heap
    kept = {mode: int(subprocess.run([*run, mode], capture_output=True, text=True, check=True, env=env).stdout) >> 20
            for mode in ("default", "pad")}  # fmt: skip
    assert kept["default"] < 16 and kept["pad"] >= 32, kept
