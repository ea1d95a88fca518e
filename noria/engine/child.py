"""The built-in engine as a child process: ``noria serve`` of a model, started from a run's config.

What this module owns: the command line of a ``noria serve`` child (model, dtype, device, every
``engine.*`` key of the run, weight version 0), its per-run API key (in its environment, never on
its command line), its log file, the wait until it answers ``/health`` (apart from the spawn, so that several engines
load side by side: ``launch_engine_server`` then ``ready_all``), and its stop. The process
itself is a ``noria.process.Child``: it dies with the thread that started it, and a failed start
names the engine and carries its log's tail.

Used by every part that starts engines: the local job (its engine and an on-policy distillation
teacher), engine fleets (``noria.launch.fleet``), the Ray launcher's engine actors, and the
evaluation fleet (``noria.eval.fleet``).

Not guaranteed: the port is picked free (``noria.net.free_port``) but may be taken before the server
binds it; the start then fails with the log's tail and is not retried here.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from noria.errors import EngineFailure
from noria.process import Child, ChildFailed

SERVE_READY_TIMEOUT_S = 600.0
"""How long a start may take: a model load on a busy 2-core CPU, or a first kernel build, takes minutes."""


def engine_device(config: Any) -> str:
    """The device of the ``noria serve`` engine a run starts: ``rollout.engine_device`` or ``model.device``."""
    return config.rollout.engine_device or config.model.device


def serve_command(path: Path, config: Any, host: str, port: int, device: str) -> list[str]:
    """``python -m noria serve`` of ``path`` with the run's dtype and every ``engine.*`` key set."""
    cmd = [sys.executable, "-m", "noria", "serve", "--model", str(path), "--host", host, "--port", str(port)]
    cmd += ["--dtype", config.model.dtype, "--device", device, "--weight-version", "0"]
    return cmd + engine_args(config.engine)


def engine_args(section: Any, prefix: str = "engine") -> list[str]:
    """``--engine.KEY VALUE`` for every set key of ``section``, a nested section's keys dotted
    (``--engine.speculative.method ngram``)."""
    args: list[str] = []
    for f in fields(section):
        value = getattr(section, f.name)
        if is_dataclass(value):
            args += engine_args(value, f"{prefix}.{f.name}")
        elif value is not None:
            args += [f"--{prefix}.{f.name}", json.dumps(value) if not isinstance(value, str) else value]
    return args


class StartingEngine:
    """A ``noria serve`` child spawned and not yet answering (:func:`launch_engine_server`). A fleet
    launches all its engines, then waits for each (:func:`ready_all`), so that they load side by side:
    two tiny-model engines (2-core AMD EPYC Zen 4) took 6.8 s each one after the other."""

    def __init__(self, child: Child, url: str, key: str, ready_timeout_s: float) -> None:
        self.child, self.url, self.key, self.ready_timeout_s = child, url, key, ready_timeout_s

    def ready(self) -> tuple[Child, str, str]:
        """Waits until it answers /health: (child, url, key); ``EngineFailure`` with the log's tail otherwise."""
        try:
            self.child.wait_http(f"{self.url}/health", self.ready_timeout_s, headers={"Authorization": f"Bearer {self.key}"})
        except ChildFailed as e:
            raise EngineFailure(str(e)) from None
        return self.child, self.url, self.key

    def stop(self) -> None:
        self.child.stop()


def ready_all(starting: list[Any]) -> list[Any]:
    """``ready()`` of each start in turn (engines launched together); on any failure every one of them
    is stopped (``stop()``), then the error raised."""
    try:
        return [s.ready() for s in starting]
    except BaseException:
        for s in starting:
            with contextlib.suppress(Exception):
                s.stop()
        raise


def launch_engine_server(
    path: Path, config: Any, folder: Path, device: str | None = None, log_name: str = "engine.log",
    api_key: str | None = None, host: str = "127.0.0.1", threads: int | None = None,
    ready_timeout_s: float = SERVE_READY_TIMEOUT_S, drain_timeout_s: float | None = None, passive_wait: bool = False,
) -> StartingEngine:
    """``noria serve`` of ``path`` spawned on a free port of ``host`` (loopback unless a launcher gives
    the node's address for other machines to reach), behind ``api_key`` (else a new one: a fleet shares
    one with its router), on ``device`` (default ``engine_device``), logging to ``folder / log_name``,
    on ``threads`` torch threads (``OMP_NUM_THREADS``; None, or that variable set here: as this
    process), draining for at most ``drain_timeout_s`` on SIGTERM (None: ``noria serve``'s 30 s).
    ``passive_wait``: its OpenMP threads sleep between parallel regions (``OMP_WAIT_POLICY=PASSIVE``,
    unless that variable is set here) instead of spinning, for a server that shares the CPU cores
    with another busy process (a judge beside the policy's engine: spinning teams of two processes
    on 2 cores took ``bench reward``'s judge_each rollout from 5.8 s to 12.7 s).
    Not waited for: ``ready()`` of the result waits until it answers /health."""
    from noria.net import free_port

    port = free_port(host)
    key = api_key or secrets.token_urlsafe(32)
    env = {"PYTHONUNBUFFERED": "1", "NORIA_API_KEY": key}
    if threads is not None and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)
    if passive_wait and "OMP_WAIT_POLICY" not in os.environ:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    cmd = serve_command(path, config, host, port, device or engine_device(config))
    if drain_timeout_s is not None:
        cmd += ["--drain-timeout", f"{drain_timeout_s:g}"]
    url = f"http://{host}:{port}"
    child = Child.start(cmd, name=f"engine server (noria serve) at {url}", log_path=folder / log_name, env=env)
    return StartingEngine(child, url, key, ready_timeout_s)


def start_engine_server(path: Path, config: Any, folder: Path, *args: Any, **options: Any) -> tuple[Child, str, str]:
    """:func:`launch_engine_server` (its arguments), waited for until it answers /health; ``EngineFailure``
    (with the log's tail) otherwise. Returns (child, url, key)."""
    return launch_engine_server(path, config, folder, *args, **options).ready()
