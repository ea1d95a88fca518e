"""What a user sees while a long phase runs: one line when it starts, a heartbeat while it lasts, its time at the end.

Every phase of a command that can take more than a few seconds (the C++ kernel build, a model
import or load, an evaluation, a checkpoint save, an export) runs inside :func:`phase`, so that no
stretch of a run is silent for more than :data:`HEARTBEAT_S` seconds, on a terminal and in a log
file alike (the CLI makes stdout and stderr line-buffered: ``noria.cli.line_buffered``).

Lines go to stderr through ``tqdm.write``, which keeps a progress bar that is on the screen intact
(and prints plainly when there is none). A leaf: imports only the standard library and tqdm.

Not guaranteed: the heartbeat is a daemon thread; a phase that holds the GIL in pure Python for
longer than the period delays its line (torch, tokenizers and compilers release it).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

HEARTBEAT_S = 3.0
"""Seconds between heartbeat lines of a running phase (below the 5 s a user waits without news)."""


def say(message: str) -> None:
    """One line on stderr, now (above a progress bar if one is drawn)."""
    from tqdm import tqdm

    tqdm.write(message, file=sys.stderr)
    sys.stderr.flush()


_ACTIVE: list[object] = []
"""The phases running now, oldest first: only the newest one beats (a nested phase, such as a model
import inside "reading the prompts and the tokenizer", replaces its parent's heartbeat)."""


@contextmanager
def phase(
    what: str,
    detail: Callable[[], str] | None = None,
    every_s: float = HEARTBEAT_S,
    end_line: bool = True,
    start_line: bool = True,
) -> Iterator[None]:
    """``noria: {what} ...`` now, ``noria: {what}: {s} s[, {detail()}]`` every ``every_s`` seconds while
    the body runs, and ``noria: {what}: done in {s} s`` when it ends (not with ``end_line=False``, where
    the caller prints the result; nothing more if it failed: the error says the rest). With
    ``start_line=False`` the caller has already said what starts (only the heartbeats are added)."""
    if start_line:
        say(f"noria: {what} ...")
    start = time.monotonic()
    stop = threading.Event()
    token = object()
    _ACTIVE.append(token)

    def beat() -> None:
        while not stop.wait(every_s):
            if _ACTIVE and _ACTIVE[-1] is not token:
                continue  # a phase inside this one is speaking: one heartbeat line at a time
            extra = f", {detail()}" if detail is not None else ""
            say(f"noria: {what}: {time.monotonic() - start:.0f} s{extra}")

    thread = threading.Thread(target=beat, name=f"noria-heartbeat: {what}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        _ACTIVE.remove(token)
    if end_line:
        say(f"noria: {what}: done in {time.monotonic() - start:.1f} s")
