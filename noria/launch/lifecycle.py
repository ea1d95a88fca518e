"""How Noria's processes end: a child dies with its parent, and SIGTERM stops a run as Ctrl-C does.

- ``die_with_parent()``: the ``preexec_fn`` of a child process (``noria serve`` started by a run):
  the kernel sends it SIGKILL when the process that started it dies, however that one died
  (SIGKILL included), so no engine is left listening with its memory (Linux ``PR_SET_PDEATHSIG``).
- ``sigterm_as_interrupt()``: from then on SIGTERM raises ``Terminated`` (a ``KeyboardInterrupt``)
  in the main thread, so ``noria train`` takes the same path as Ctrl-C: the running step finishes or
  is abandoned, logs are flushed, children are stopped, a message says how to resume, and the exit
  code is 143 (130 for Ctrl-C).

What blocks on what: the exception is raised where the main thread is; the trainer's step runs in a
worker thread that asyncio waits for before the run's ``finally`` stops the children.

Not guaranteed: ``PR_SET_PDEATHSIG`` fires when the *thread* that started the child exits, so
children must be started from the main thread (``Job.build`` does); other operating systems than
Linux get no parent-death signal.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1

_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None  # resolved before any fork


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived; handled like Ctrl-C."""


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` after which the child gets SIGKILL when this process dies."""
    parent = os.getpid()

    def arm() -> None:  # runs in the child between fork and exec: no imports, no locks
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm


def sigterm_as_interrupt() -> None:
    """From now on SIGTERM raises :class:`Terminated` in the main thread."""

    def raise_terminated(signum: int, frame: object) -> None:
        raise Terminated(f"received signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, raise_terminated)


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """The shell's convention: 128 + the signal's number (143 for SIGTERM, 130 for SIGINT)."""
    return 128 + (signal.SIGTERM if isinstance(interrupt, Terminated) else signal.SIGINT)
