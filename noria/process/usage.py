"""What a run's processes hold: the process tree under a pid and its peak resident memory.

Read from ``/proc`` (Linux): ``/proc/PID/task/TID/children`` lists each thread's children, and
``VmHWM`` in ``/proc/PID/status`` is a process's peak resident set ("high water mark"). psutil would
do the same walk; it is not a dependency of Noria, and these two files are all that is needed.

``tree_peak_rss_bytes`` sums the peaks of the run's living processes (the job, its engines, eval
fleet, ranks, router): an upper bound of the run's simultaneous peak, and equal to it when the
processes peak together (colocated runs: one process). A process that has exited is no longer
counted. ``tree`` and ``rss_bytes`` serve whoever samples a run from outside (the soak benchmark).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PROC = Path("/proc")


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (any of its threads'); [] once it is gone."""
    out: list[int] = []
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return out


def tree(pid: int | None = None) -> list[int]:
    """``pid`` (default: this process) and every living descendant, parents before children."""
    root = os.getpid() if pid is None else pid
    out, todo = [], [root]
    while todo:
        p = todo.pop(0)
        if p in out:
            continue
        out.append(p)
        todo += children(p)
    return out


def status_bytes(pid: int, field: str) -> int:
    """A ``kB`` field of ``/proc/PID/status`` (``VmRSS``, ``VmHWM``) in bytes; 0 if the process is gone."""
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def rss_bytes(pids: list[int]) -> int:
    """The current resident memory of ``pids``, summed."""
    return sum(status_bytes(p, "VmRSS") for p in pids)


def tree_peak_rss_bytes(pid: int | None = None) -> int:
    """The peak resident memory of ``pid``'s tree (default: this process's), summed over its processes."""
    return sum(status_bytes(p, "VmHWM") for p in tree(pid))


def memory_metrics() -> dict[str, float]:
    """``memory/peak_rss_gb`` of this process's tree, and the GPU's peak allocated memory where CUDA is in use."""
    row = {"memory/peak_rss_gb": tree_peak_rss_bytes() / 1e9}
    torch = sys.modules.get("torch")  # not imported here: a run without torch has no GPU figure
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        row["memory/gpu_peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return row


_LIBC: object | None = None
M_TOP_PAD = -2  # glibc's mallopt parameter number (malloc.h)
HEAP_TOP_PAD = 64 << 20


def _libc() -> object:
    """glibc through ctypes, or False where the C library lacks ``malloc_trim`` or ``mallopt`` (musl, macOS)."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC = lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else False
        except OSError:
            _LIBC = False
    return _LIBC


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the kernel (glibc ``malloc_trim(0)``); a no-op elsewhere.

    glibc keeps memory freed by a thread in that thread's arena (64 MiB heaps), and raises its mmap
    threshold after large frees, so the buffers a process allocates and frees at every step (weight
    staging, logit chunks, HTTP bodies) leave free pages that still count as resident. Long runs saw
    that as slow RSS growth spread over the trainer and engines (docs/guarantees.md, "Long runs").
    ``malloc_trim(0)`` walks every arena and releases whole free pages (``madvise``), without moving
    live data. Called after a weight commit in the engine and after each training step.
    """
    lib = _libc()
    if lib:
        lib.malloc_trim(0)  # type: ignore[attr-defined]


def pad_heap_top() -> bool:
    """Keep ``HEAP_TOP_PAD`` (64 MiB) of free memory at the top of each C heap (glibc
    ``mallopt(M_TOP_PAD)``, process-wide; a no-op without glibc).

    By default glibc gives the top of a heap back to the kernel as soon as more than 128 KiB is free
    there, and asks for it again at the next allocation, so a loop of many small forward passes,
    each allocating and freeing a few MB of activations, faults in fresh zeroed pages at every one.
    The diffusion engine's denoising steps on a CPU are that loop: on a 2-core EPYC Zen 3 (fp32,
    the digits DiT, 10 steps) a batch of 64 images took 364 ms (median of 25) with glibc's defaults
    and 231 ms with this pad; batch 8, 104 and 72 ms; and the spread from one call to the next
    (225 to 455 ms) shrank to 214-251 ms. The text engine and trainer measured no change (the main
    job's five steps: 159 s either way), so only the CPU diffusion engine sets it. The
    cost is at most the pad per heap of resident memory; ``release_free_memory`` still trims it.
    Returns whether glibc took the setting.
    """
    lib = _libc()
    return bool(lib) and lib.mallopt(M_TOP_PAD, HEAP_TOP_PAD) == 1  # type: ignore[attr-defined]
