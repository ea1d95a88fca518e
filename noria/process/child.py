"""One child process's whole life: started with the right environment, waited for, signalled,
stopped, reaped, and never outliving this process.

Every server, rank and worker Noria starts goes through here (``noria serve`` engines, vLLM
servers, the sglang-router, evaluation fleets, trainer ranks, benchmark workers), so each of them
gets the same guarantees:

- environment: this process's, with NVLink multicast off (``noria.process.env.child_env``) plus
  what the caller adds; secrets (API keys) travel there, never on a command line;
- death with the parent: the kernel SIGKILLs the child when the thread that started it dies,
  however it died (``noria.process.lifecycle.die_with_parent``); a child started after its parent
  died exits before running anything;
- readiness: ``wait_ready(check)`` polls until the child answers (``wait_http`` for a ``/health``
  route), and fails with the tail of its log if it exits first or is not ready in time (it is
  stopped first, so nothing is left running);
- stopping: ``stop()`` sends SIGTERM (and SIGCONT, so a stopped child can act on it), waits, then
  SIGKILL; with ``group=True`` the signals go to the child's whole process group (a server that
  runs helpers of its own, like vLLM's engine core); the child is always reaped and its log closed.

``run(cmd)`` is the same for a command that runs to completion (a pip install, a benchmark side):
it dies with this process too. ``start_process(target, args)`` starts a Python function in a fresh
interpreter (``multiprocessing``'s spawn context) that arms the parent-death signal before it runs
``target``: trainer ranks; ``spawn(fn, args, nprocs)`` is ``torch.multiprocessing.spawn`` with that
guard.

What blocks on what: ``start`` returns once the process exists; ``wait_ready`` and ``stop`` block
the calling thread. Not guaranteed: the parent-death signal is per thread (start children from a
thread that lives as long as they should: the main thread, or a dedicated one); grandchildren of a
child that is not its own group are the child's own business; other operating systems than Linux
get no parent-death signal.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from noria.errors import NoriaError
from noria.process.env import child_env
from noria.process.lifecycle import arm_parent_death, die_with_parent

POLL_S = 0.2
"""How often ``wait_ready`` looks again."""


class ChildFailed(NoriaError):
    """A child exited while starting or was not ready in time; the message names it and has its log's tail."""


class Child:
    """A child process of this one, from start to reap (module docstring)."""

    def __init__(self, name: str, popen: subprocess.Popen, log_path: Path | None, group: bool, log: IO[Any] | None) -> None:
        self.name = name
        self.popen = popen
        self.log_path = log_path
        self.group = group
        """Whether the child leads its own process group (signals then go to the whole group)."""
        self._log = log

    @classmethod
    def start(
        cls, cmd: Sequence[str], *, name: str, log_path: str | Path | None = None, env: Mapping[str, str] | None = None,
        group: bool = False, cwd: str | Path | None = None, stdout: Any = None, stdin: Any = subprocess.DEVNULL,
    ) -> Child:
        """Start ``cmd`` (stdout and stderr appended to ``log_path``, else to ``stdout``, else inherited),
        with ``child_env(**env)``, dying with this thread; ``group``: in a new session of its own."""
        log = None
        if log_path is not None:
            log_path = Path(log_path)
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(log_path, "ab")  # noqa: SIM115 -- closed by stop()
            stdout = log
        popen = subprocess.Popen(
            list(cmd), stdout=stdout, stderr=subprocess.STDOUT if log is not None else None, stdin=stdin,
            env=child_env(**(env or {})), cwd=cwd, start_new_session=group, preexec_fn=die_with_parent(),
        )  # fmt: skip
        return cls(name, popen, log_path, group, log)

    # ------------------------------------------------------------------------------ state

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        """The exit code once it has exited (and been reaped), else None."""
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def exit_note(self) -> str:
        """How it ended, for errors: ``exit code 1``, ``killed by SIGKILL``, or ``running``."""
        code = self.popen.poll()
        if code is None:
            return "running"
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    def tail(self, chars: int = 3000) -> str:
        """The end of its log (or a note that there is none)."""
        if self.log_path is None:
            return "(no log)"
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as e:
            return f"(log unreadable: {e})"

    # ------------------------------------------------------------------------------ readiness

    def wait_ready(self, check: Callable[[], bool], timeout_s: float, what: str = "ready") -> None:
        """Poll ``check()`` (exceptions count as not yet) until it is true; ``ChildFailed`` with the log's
        tail when the child exits first or ``timeout_s`` passes (the child is stopped then)."""
        try:
            self._poll_until(check, timeout_s, what)
        except BaseException:  # a failed start, or Ctrl-C meanwhile: nothing is left running
            self.stop()
            raise

    def _poll_until(self, check: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.popen.poll() is not None:
                raise ChildFailed(f"{self.name} exited ({self.exit_note()}) while starting (log {self.log_path}):\n{self.tail()}")
            try:
                if check():
                    return
            except Exception:  # noqa: BLE001 -- not answering yet, whatever the error
                pass
            if time.monotonic() >= deadline:
                raise ChildFailed(f"{self.name} was not {what} within {timeout_s:g} s (log {self.log_path}):\n{self.tail()}")
            time.sleep(POLL_S)

    def wait_http(self, url: str, timeout_s: float, headers: Mapping[str, str] | None = None) -> None:
        """``wait_ready`` until ``GET url`` answers 200 (a ``/health`` route)."""

        def answers() -> bool:
            with urllib.request.urlopen(urllib.request.Request(url, headers=dict(headers or {})), timeout=2) as r:
                return r.status == 200

        self.wait_ready(answers, timeout_s, f"healthy at {url}")

    # ------------------------------------------------------------------------------ signals, stop

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child (its whole group with ``group``); nothing if it is gone."""
        if self.popen.poll() is not None and not self.group:
            return
        try:
            if self.group:
                os.killpg(self.popen.pid, sig)
            else:
                self.popen.send_signal(sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for it to exit (``subprocess.TimeoutExpired`` after ``timeout_s``) and reap it."""
        return self.popen.wait(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (and SIGCONT), SIGKILL after ``timeout_s``; reaped, log closed. Returns the exit code."""
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            self.signal(signal.SIGCONT)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        if self.group:
            self.signal(signal.SIGKILL)  # what is left of its group (a helper that outlived its leader)
        elif self.popen.poll() is None:
            self.popen.kill()
        code = self.popen.wait()
        self.close_log()
        return code

    def kill(self) -> int:
        """SIGKILL now (the group with ``group``), reaped."""
        return self.stop(timeout_s=0) if self.popen.poll() is None else self.popen.wait()

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run(
    cmd: Sequence[str], *, check: bool = True, input: str | None = None, capture: bool = False,
    env: Mapping[str, str] | None = None, cwd: str | Path | None = None, timeout_s: float | None = None,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` to completion (``subprocess.run``), dying with this process; ``capture``: its
    stdout and stderr as text in the result; ``check``: ``CalledProcessError`` on a non-zero exit."""
    return subprocess.run(
        list(cmd), check=check, input=input, capture_output=capture, text=capture or input is not None,
        env=child_env(**(env or {})), cwd=cwd, timeout=timeout_s, preexec_fn=die_with_parent(),
    )  # fmt: skip


# ---------------------------------------------------------------------------------- Python processes


def _guarded(parent: int, target: Callable[..., Any], *args: Any) -> Any:
    """In the spawned interpreter: die with ``parent`` (exit at once if it is already gone), then run."""
    arm_parent_death(parent)
    return target(*args)


def spawn_context() -> Any:
    """``multiprocessing``'s spawn context (a fresh interpreter: no forked threads or CUDA state)."""
    return multiprocessing.get_context("spawn")


def start_process(target: Callable[..., Any], args: tuple, name: str, daemon: bool = True) -> Any:
    """``target(*args)`` in a spawned interpreter that dies with this thread; started. A
    ``multiprocessing.Process`` (``exitcode``, ``join``, ``kill``); pipes come from ``spawn_context()``."""
    process = spawn_context().Process(target=_guarded, args=(os.getpid(), target, *args), name=name, daemon=daemon)
    process.start()
    return process


def spawn(fn: Callable[..., Any], args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``, each process dying with this one; joins them
    and raises the first failure (torch's ``ProcessRaisedException`` / ``ProcessExitedException``)."""
    import torch.multiprocessing as mp

    mp.spawn(_guarded_rank, args=(os.getpid(), fn, args), nprocs=nprocs, join=True)


def _guarded_rank(rank: int, parent: int, fn: Callable[..., Any], args: tuple) -> Any:
    arm_parent_death(parent)
    return fn(rank, *args)
