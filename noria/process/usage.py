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


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the kernel (glibc ``malloc_trim(0)``); a no-op elsewhere.

    glibc keeps memory freed by a thread in that thread's arena (64 MiB heaps), and raises its mmap
    threshold after large frees, so the buffers a process allocates and frees at every step (weight
    staging, logit chunks, HTTP bodies) leave free pages that still count as resident. Long runs saw
    that as slow RSS growth spread over the trainer and engines (docs/guarantees.md, "Long runs").
    ``malloc_trim(0)`` walks every arena and releases whole free pages (``madvise``), without moving
    live data. Called after a weight commit in the engine and after each training step.
    """
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC = lib if hasattr(lib, "malloc_trim") else False
        except OSError:  # not glibc (musl, macOS): nothing to trim
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)  # type: ignore[attr-defined]
