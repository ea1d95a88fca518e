"""Giving a thread's OpenMP workers back, so that torch work on another thread of the process gets
the cores at full speed.

Why: torch's CPU kernels parallelise through OpenMP (libgomp on Linux), and every thread that runs a
parallel torch op gets its own team of worker threads, kept for the life of that thread. Between
two parallel regions libgomp's workers spin for a while before they sleep, which is what makes a
stream of small ops fast; but once the process holds more libgomp workers than it has cores, libgomp
cuts the spin to almost nothing (its "throttled" spin count), so every parallel region of every
thread first wakes a sleeping worker. A DiT denoising step is hundreds of small ops: on a 2-core
EPYC Zen 4, diffusers' sampling loop of the digits DiT (bf16, batch 8) ran 134-156 images/s on the
main thread and 71-92 on a second thread while the main thread's (idle) team existed; with the main
thread's team given back first, 158-162 on the second thread. The diffusion engine steps on its own
thread while the threads that asked for images wait, so it gives their teams back
(:func:`release_workers` on the caller's thread) and gives its own back when it goes idle.

A team given back is rebuilt by the thread's next parallel op (one thread start, tens of
microseconds); results do not change (the same kernels run with the same thread count).

Not guaranteed: only libgomp is handled (``omp_pause_resource_all``, OpenMP 5.0, GCC 9 and later);
with another OpenMP runtime, or none, this does nothing. Two threads that run torch at the same
time still throttle each other.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_OMP_PAUSE_SOFT = 1
"""``omp_pause_soft``: free the calling thread's runtime resources (its worker threads)."""


def released(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn``, giving its thread's OpenMP team back when it returns: for the tasks of long-lived helper
    threads (thread pools), whose idle teams would otherwise stay for the life of the thread."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            release_workers()

    return run


def release_workers() -> None:
    """Give the calling thread's OpenMP workers back (a no-op when it has none, or outside libgomp)."""
    for pause in _pause_functions():
        pause(_OMP_PAUSE_SOFT)


@functools.lru_cache(maxsize=1)
def _pause_functions() -> tuple[Callable[[int], int], ...]:
    """``omp_pause_resource_all`` of every libgomp loaded in this process (torch's own copy, and any
    other: each one's teams are separate)."""
    import torch  # noqa: F401 -- loads the libgomp torch runs on before the process map is read

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux
        return ()
    paths = sorted({line.split()[-1] for line in maps.splitlines() if Path(line.split()[-1]).name.startswith("libgomp")})
    functions = []
    for path in paths:
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # an older libgomp without OpenMP 5.0's pause
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        functions.append(pause)
    return tuple(functions)
