"""Fault points: named places where a test, or a chaos drill, makes this process stop, die or fail
on purpose, at exactly that point of its work.

Armed by the environment variable ``NORIA_FAULTS`` (read once, at the first point reached), a
comma-separated list of ``POINT=ACTION[@N]``::

    NORIA_FAULTS="checkpoint.partial_written=stop@2"      stop at the second checkpoint, before its commit
    NORIA_FAULTS="checkpoint.committed=kill"               SIGKILL right after the first commit

Actions: ``stop`` (SIGSTOP itself: the test that armed it sees the process stopped, then kills or
continues it, so a kill lands inside a window that lives for milliseconds, every time), ``kill``
(SIGKILL itself), ``raise:ENAME`` (``OSError`` with that errno, ``ENOSPC``, ``EROFS``, ``EIO``...: what
a failing disk raises at that point). ``@N`` fires on the N-th time the point is reached (1-based;
default: every time).

Why our own and not LD_PRELOAD or a mount: a named point says where in Noria's logic the fault lands
(after the model files, before the commit marker), which a system-call filter cannot; and it works
in CI as any user. Unset (the default), a point costs one dictionary lookup. This module is a leaf
(standard library only); ``POINTS`` lists every point, and a point not listed there is refused.
"""

from __future__ import annotations

import errno
import os
import signal
from collections import Counter

POINTS = {
    "checkpoint.partial_written": "noria.train.checkpoint.save_checkpoint: every file is in the hidden partial folder, "
    "COMMITTED not yet written (a crash here must leave the last committed checkpoint the one resumed)",
    "checkpoint.committed": "noria.train.checkpoint.save_checkpoint: the checkpoint is committed and in place",
    "metrics.write": "noria.metrics.RunLog.append: a line of metrics.jsonl or eval.jsonl is about to be written",
    "train.step": "noria.train.rl_step.rl_step: the trainer's step is about to run (colocated: the engine is paused and "
    "its memory released until the step's weight sync; a stop here must not be masked by the engine's resume)",
    "sync.disk_write": "noria.sync.disk: a pushed version's tensors are written into its hidden partial folder, "
    "not yet published (the engines must keep serving the previous version)",
    "rollout.in_flight_recorded": "noria.rollout.scheduler.record_in_flight: every request in flight is stopped with "
    "its tokens and recorded, the checkpoint not yet written (a crash here must lose none of them)",
    "rollout.in_flight_continued": "noria.rollout.generate.generate_one: a trajectory holding tokens (stopped by a "
    "checkpoint, or recorded in one and resumed) is about to send the request that continues it",
}
"""Every fault point: name -> where it is and what holds there."""

ENV = "NORIA_FAULTS"

_armed: dict[str, tuple[str, int | None]] | None = None
_reached: Counter[str] = Counter()


class FaultSpecError(ValueError):
    """``NORIA_FAULTS`` names an unknown point or action."""


def parse(spec: str) -> dict[str, tuple[str, int | None]]:
    """``POINT=ACTION[@N],...`` -> {point: (action, N or None)}; ``FaultSpecError`` naming what is wrong."""
    armed: dict[str, tuple[str, int | None]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, _, action = item.partition("=")
        action, _, nth = action.partition("@")
        if point not in POINTS:
            raise FaultSpecError(f"{ENV}: unknown fault point {point!r}; the points are {', '.join(sorted(POINTS))}")
        if action not in ("stop", "kill") and not (action.startswith("raise:") and hasattr(errno, action[6:])):
            raise FaultSpecError(f"{ENV}: {item!r}: the action must be stop, kill or raise:ERRNO (raise:ENOSPC, ...)")
        if nth and not (nth.isdigit() and int(nth) >= 1):
            raise FaultSpecError(f"{ENV}: {item!r}: @N must be a whole number from 1")
        armed[point] = (action, int(nth) if nth else None)
    return armed


def point(name: str) -> None:
    """Reached fault point ``name``: act if ``NORIA_FAULTS`` arms it for this time (module docstring)."""
    global _armed
    if name not in POINTS:
        raise KeyError(f"fault point {name!r} is not in noria.faults.POINTS")
    if _armed is None:
        _armed = parse(os.environ.get(ENV, ""))
    if name not in _armed:
        return
    _reached[name] += 1
    action, nth = _armed[name]
    if nth is not None and _reached[name] != nth:
        return
    if action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        code = getattr(errno, action[6:])
        raise OSError(code, f"{os.strerror(code)} (fault point {name}, {ENV})")
