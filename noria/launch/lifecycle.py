"""How Noria's processes end: a child dies with its parent, and SIGTERM stops a run as Ctrl-C does.

- ``die_with_parent()``: the ``preexec_fn`` of a child process (``noria serve`` started by a run):
  the kernel sends it SIGKILL when the process that started it dies, however that one died
  (SIGKILL included), so no engine is left listening with its memory (Linux ``PR_SET_PDEATHSIG``).
- ``sigterm_as_interrupt()``: from then on SIGTERM raises ``Terminated`` (a ``KeyboardInterrupt``)
  in the main thread, so ``noria train`` takes the same path as Ctrl-C: the running step finishes or
  is abandoned, logs are flushed, children are stopped, a message says how to resume, and the exit
  code is 143 (130 for Ctrl-C).
- ``sigterm_cancels_task()``: while the RL loop's event loop runs, SIGTERM does what asyncio does
  for Ctrl-C: it cancels the loop's task at its next ``await`` and ``Terminated`` is raised from
  there. Code between two awaits (a checkpoint being written, the bookkeeping of a step) is never
  cut in the middle.

What blocks on what: the trainer's step runs in a worker thread that asyncio waits for before the
run's ``finally`` stops the children, so a step in progress finishes (its result is not logged).

Not guaranteed: ``PR_SET_PDEATHSIG`` fires when the *thread* that started the child exits, so
children must be started from the main thread (``Job.build`` does); other operating systems than
Linux get no parent-death signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable, Iterator

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


@contextlib.contextmanager
def sigterm_cancels_task() -> Iterator[None]:
    """Inside a running event loop: SIGTERM cancels the current task at its next await; the
    cancellation leaves this block as :class:`Terminated`. The previous SIGTERM handler is restored."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    previous, received = signal.getsignal(signal.SIGTERM), []

    def cancel() -> None:
        received.append(True)
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, cancel)
    try:
        yield
    except asyncio.CancelledError:
        if received:
            raise Terminated("received signal SIGTERM") from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous)


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """The shell's convention: 128 + the signal's number (143 for SIGTERM, 130 for SIGINT)."""
    return 128 + (signal.SIGTERM if isinstance(interrupt, Terminated) else signal.SIGINT)
