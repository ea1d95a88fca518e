"""Process-wide memory settings a training run applies before its first matmul.

oneDNN (torch's CPU matmuls) keeps a JIT-compiled kernel for every matmul shape it has run, in a
primitive cache of 1024 entries by default (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``). A trainer's
shapes change with every batch (the packed token count), so the cache keeps growing for hundreds
of steps: the main job's peak RSS rose by about 60 MB a step (2.95 -> 3.10 GB over 6 steps; with a
capacity of 64: flat at 2.97 GB, rollout tokens/s 5-10% lower, 2-core AMD EPYC Zen 4).
ideep (torch's wrapper around oneDNN) keeps its own cache of matmul computations
(``LRU_CACHE_CAPACITY``, 1024 too). ``train.onednn_cache_capacity`` sets the capacity of both for
the run's process; they are read when the first primitive is made, so ``noria train`` applies it
right after loading the config, before any model is built. A value already in the environment
wins. Bounding oneDNN's cache alone, the main job's 20-step peak still rose 2.95 -> 3.24 GB; both
at 64, it stayed at 2.92 GB from step 1 to 20 at the same step times (7-11 s).

``noria serve`` applies ``engine.onednn_cache_capacity`` (64 by default) the same way, before its
model loads: a decode batch's row count changes with every admitted and finished request, so an
engine meets hundreds of shapes. On tiny-llama, 600 batches of 1-24 requests of mixed lengths
(2-core AMD EPYC Zen 4): RSS 393 -> 656 MB and still rising with the defaults, flat at 433 MB with
64, 545 MB with 256, in the same time (50 s, 47 s, 48 s). It was the rise the 60-minute soak
(``noria bench soak``) measured in every engine (+50 to +70 MB each; the Python heap grew 0.2 MB).
The engines ``noria train`` starts inherit its ``train.onednn_cache_capacity`` when that is set.
"""

from __future__ import annotations

import os

ONEDNN_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
"""oneDNN's primitive cache, and ideep's (torch's oneDNN wrapper) cache of matmul computations."""


def bound_onednn_cache(capacity: int | None) -> bool:
    """Set the capacity of both caches for this process (and its children), each unless the
    environment already sets it; True if any was set here. Effective only before the first CPU matmul."""
    if capacity is None:
        return False
    unset = [key for key in ONEDNN_CACHE_ENV if key not in os.environ]
    for key in unset:
        os.environ[key] = str(int(capacity))
    return bool(unset)
