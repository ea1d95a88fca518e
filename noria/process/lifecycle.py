"""How Noria's processes end: a child dies with its parent, and SIGTERM stops a run as Ctrl-C does.

- ``die_with_parent()``: the ``preexec_fn`` of a child process (``noria.process.child`` gives it to
  every child; ``arm_parent_death`` is the same for a spawned Python process, armed as it starts):
  the kernel sends it SIGKILL when the process that started it dies, however that one died
  (SIGKILL included), so no engine is left listening with its memory (Linux ``PR_SET_PDEATHSIG``).
- ``sigterm_as_interrupt()``: from then on SIGTERM raises ``Terminated`` (a ``KeyboardInterrupt``)
  in the main thread, so ``noria train`` takes the same path as Ctrl-C: the running step finishes or
  is abandoned, logs are flushed, children are stopped, a message says how to resume, and the exit
  code is 143 (130 for Ctrl-C).
- ``signals_cancel_task()``: while the RL loop's event loop runs, SIGTERM and Ctrl-C (SIGINT)
  cancel the loop's task at its next ``await``, and ``Terminated`` (SIGTERM) or ``KeyboardInterrupt``
  is raised from there. Code between two awaits (a checkpoint being written, the bookkeeping of a
  step) is never cut in the middle. The cancellation is made again if the task stops being
  cancelled before it ends: a library that absorbs one (an HTTP client's timeout scope meeting it at the same moment:
  a run once went on to its last step after a Ctrl-C) does not keep the run going.

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
        arm_parent_death(parent)

    return arm


def arm_parent_death(parent: int) -> None:
    """In a child of ``parent``: SIGKILL this process when its parent (thread) dies; exit at once
    if the parent already died before the signal was armed (the orphan's parent is then another)."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def sigterm_as_interrupt() -> None:
    """From now on SIGTERM raises :class:`Terminated` in the main thread."""

    def raise_terminated(signum: int, frame: object) -> None:
        raise Terminated(f"received signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, raise_terminated)


@contextlib.contextmanager
def signals_cancel_task() -> Iterator[None]:
    """Inside a running event loop: SIGTERM or SIGINT cancels the current task at its next await
    (and again, checked every ``RECANCEL_S``, if something absorbed the cancellation); the cancellation leaves this block as
    :class:`Terminated` or ``KeyboardInterrupt``. The previous handlers are restored."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    signals = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.getsignal(s) for s in signals}
    received: list[int] = []

    def cancel() -> None:
        if task.done():
            return
        if task.cancelling() == 0:  # not (or no longer: absorbed) being cancelled
            task.cancel()
        loop.call_later(RECANCEL_S, cancel)

    def on_signal(signum: int) -> None:
        if not received:
            received.append(signum)
            cancel()

    for s in signals:
        loop.add_signal_handler(s, on_signal, s)
    try:
        yield
    except asyncio.CancelledError:
        if received == [signal.SIGTERM]:
            raise Terminated("received signal SIGTERM") from None
        if received:
            raise KeyboardInterrupt() from None
        raise
    finally:
        for s in signals:
            loop.remove_signal_handler(s)
            signal.signal(s, previous[s])


RECANCEL_S = 0.5
"""How often a signal's cancellation is made again while the task runs on."""


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """The shell's convention: 128 + the signal's number (143 for SIGTERM, 130 for SIGINT)."""
    return 128 + (signal.SIGTERM if isinstance(interrupt, Terminated) else signal.SIGINT)
