"""How callers reach an engine that steps on a background thread: the thread and its command inbox,
and the request plumbing around ``submit``. Shared by the text engine (``noria.engine.engine``) and
the diffusion engine (``noria.diffusion.engine``), which differ in what a step is, not in this.

Data flow::

    callers (asyncio or threads)                  EngineThread (the only thread touching engine state)
    post(command) / post_future / call  ──▶ inbox ──▶ drain(): run every queued command between steps
    generate / generate_batch: submit(req, callback)   callback(output) on the engine thread
      ◀── the output, through call_in_loop (asyncio) or an event per batch (threads)

What blocks on what: ``post`` never blocks; ``call`` (and ``post_future``'s result) waits until the
current step ends and the command has run, except on the engine thread itself (a callback) or after
the thread has ended, where the command runs at once (no step can be in flight then); ``await
generate`` until the request's final output, whose callback comes once for a request submitted
without streaming; cancelling that await aborts the request; ``shutdown`` until the thread ends.

Not guaranteed: commands posted after the thread has ended run nowhere (``post`` raises only once
the loop failed, ``EngineDead``); an output whose caller's event loop has closed is dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from noria import openmp
from noria.engine.protocol import RequestError

log = logging.getLogger(__name__)

PAUSE_MODES = ("retract", "in_place")
"""``pause(mode)`` of every engine: ``retract`` frees what a paused request holds, ``in_place`` keeps it."""


def check_pause_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise RequestError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")


class EngineDead(RuntimeError):
    """The engine thread stopped on an error; every in-flight request was aborted with it."""


class EngineThread:
    """An engine's background thread (running ``run``) and the inbox of commands it runs between steps."""

    def __init__(self, run: Callable[[], None], name: str, cpu: bool = False) -> None:
        self.cpu = cpu
        """The engine computes on the CPU: threads give their OpenMP teams back (:meth:`give_back_workers`)."""
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self.error: BaseException | None = None
        """What stopped the loop (:meth:`fail`); None while it runs."""
        self.closing = False
        """Set by :meth:`shutdown`: the engine refuses new requests."""
        self.stopping = False
        """Set on the thread by shutdown's last command: the loop ends before its next step."""

    def start(self) -> None:
        self._thread.start()
        self.give_back_workers()  # the building thread's team, made by the model load and the packing

    def give_back_workers(self, idle: bool = False) -> None:
        """A CPU engine: the calling thread gives its OpenMP team back (``noria.openmp``). From the
        threads that build the engine and submit to it, which then wait while the engine thread
        computes (an idle team beside the engine's makes libgomp stop spinning, and every parallel op
        of a step then wakes a sleeping worker: decode ran up to 1.7x slower); on the engine thread, only
        with ``idle`` (its loop has no work: its team would slow the other threads' torch work)."""
        if self.cpu and (idle or threading.current_thread() is not self._thread):
            openmp.release_workers()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def idle(self) -> bool:
        """No command waits in the inbox."""
        return self._inbox.empty()

    # ------------------------------------------------------------------------------ callers

    def post(self, command: Callable[[], None]) -> None:
        """Queue ``command`` for the engine thread; raises EngineDead once the loop failed."""
        self.check_alive()
        self._inbox.put(command)

    def post_future(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the engine thread between two steps; the future gets its result or error."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 -- handed to the caller through the future
                future.set_exception(e)

        if threading.current_thread() is self._thread or not self._thread.is_alive():
            run()  # called from a callback, or after shutdown: no step can be in flight
        else:
            self.post(run)
        return future

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run between two steps; blocks until it has run."""
        return self.post_future(fn).result()

    def check_alive(self) -> None:
        if self.error is not None:
            raise EngineDead(f"the engine loop stopped: {type(self.error).__name__}: {self.error}")

    def check_accepting(self) -> None:
        """Before a new request: EngineDead once the loop failed, RequestError once shutdown began."""
        self.check_alive()
        if self.closing:
            raise RequestError("the engine is shutting down and accepts no new requests")

    def shutdown(self, busy: Callable[[], bool], abort_all: Callable[[], None], drain_timeout_s: float) -> None:
        """Refuse new requests, wait up to ``drain_timeout_s`` while ``busy()``, ``abort_all()``, stop
        the loop and wait for the thread to end."""
        self.closing = True
        deadline = time.monotonic() + drain_timeout_s
        while self._thread.is_alive() and busy() and time.monotonic() < deadline:
            time.sleep(0.01)
        abort_all()
        self.post(self._stop)
        self._thread.join()

    def _stop(self) -> None:
        self.stopping = True

    # ------------------------------------------------------------------------------ engine thread

    def drain(self, block: bool, timeout: float | None = None) -> None:
        """Run the queued commands; with ``block``, first wait up to ``timeout`` for one."""
        try:
            command = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        command()
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            command()

    def fail(self, error: BaseException) -> None:
        """The loop died of ``error``: record it (later posts raise EngineDead) and run what is
        queued (submits, futures of commands) so that nobody waits forever; the engine then aborts
        its requests."""
        log.error("%s: engine loop stopped", self._thread.name, exc_info=error)
        self.error = error
        while True:
            try:
                self._inbox.get_nowait()()
            except queue.Empty:
                break
            except Exception:
                log.exception("command failed after the engine loop stopped")


async def generate(submit: Callable[..., str], abort: Callable[[str], None], req: Any) -> Any:
    """``submit(req, callback)`` and wait for the request's final output; cancelling the await
    calls ``abort(rid)``."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()
    rid = submit(req, lambda out: call_in_loop(loop, _resolve, future, out))
    try:
        return await future
    except asyncio.CancelledError:
        abort(rid)
        raise


def generate_batch(submit: Callable[..., Any], requests: list, timeout_s: float | None = None, *, many: bool = False) -> list:
    """Blocking convenience for scripts, tests and benchmarks: submit all, wait for all (at most
    ``timeout_s`` in all, then ``TimeoutError``), outputs in order. ``submit(req, callback)``, or with
    ``many`` ``submit(requests, callbacks)`` (one command for all).

    One event for the batch, not a future per request: each future's condition costs the engine
    thread a notify per output (a 64-image batch of the digits DiT took ~0.3 ms more on a 2-core EPYC)."""
    outputs: list = [_PENDING] * len(requests)
    left = [len(requests)]
    lock, done = threading.Lock(), threading.Event()

    def deliver(i: int, out: Any) -> None:
        with lock:
            if outputs[i] is not _PENDING:  # a request's final output comes once; a second is not counted
                return
            outputs[i] = out
            left[0] -= 1
            if left[0] == 0:
                done.set()

    callbacks = [functools.partial(deliver, i) for i in range(len(requests))]
    if many:
        submit(requests, callbacks)
    else:
        for req, callback in zip(requests, callbacks, strict=True):
            submit(req, callback)
    if requests and not done.wait(timeout_s):
        raise TimeoutError(f"{left[0]} of {len(requests)} requests were not done after {timeout_s} s")
    return outputs


_PENDING = object()


def call_in_loop(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    """``fn(*args)`` on the caller's event loop, from the engine thread."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's event loop has closed: nobody is waiting for this output
        pass


def _resolve(future: asyncio.Future, out: Any) -> None:
    if not future.done():
        future.set_result(out)
