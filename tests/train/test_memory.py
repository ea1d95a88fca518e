"""Memory of the colocated main job's parts: the KV pools cost only the blocks written, also when
the C heap has churned (as after a trainer turn, when the engine allocates them again), and go back
to the kernel when dropped (``noria.engine.kv_cache.zeroed_pools``)."""

from __future__ import annotations

import gc
import os

import torch

from noria.engine.kv_cache import zeroed_pools
from noria.process.usage import status_bytes


def _rss() -> int:
    return status_bytes(os.getpid(), "VmRSS")


def test_small_kv_pools_stay_lazy_after_a_large_free_and_go_back_to_the_kernel():
    # A 20 MB buffer freed first raises glibc's dynamic mmap threshold above a 12.6 MB pool, so
    # malloc would serve the pools from the heap (as after a trainer step).
    big = torch.ones(5 * 2**20)
    del big
    gc.collect()
    shape = (32768, 3, 64)  # SmolLM2-135M's pool at 32768 tokens: 12.6 MB a layer
    before = _rss()
    k, v = zeroed_pools(30, shape, torch.bfloat16, "cpu")
    assert sum(p.numel() * p.element_size() for p in k + v) == 2 * 30 * 32768 * 3 * 64 * 2  # 755 MB
    assert _rss() - before < 32 * 2**20
    assert k[7][:100].abs().sum().item() == 0 and v[29][-1].abs().sum().item() == 0
    for pool in k + v:  # every layer writes its first 1024 slots (64 blocks of 16)
        pool[:1024] = 1.0
    touched = 60 * 1024 * 3 * 64 * 2
    assert _rss() - before < touched + 32 * 2**20
    assert k[3][:1024].float().sum().item() == 1024 * 3 * 64 and k[3][1024:].abs().sum().item() == 0
    del k, v, pool
    gc.collect()
    assert _rss() - before < 16 * 2**20  # unmapped, not kept in the heap
