"""Start and stop the real sglang-router (PyPI ``sglang-router``, a Rust binary) as a subprocess.

``SglangRouter(worker_urls, port=P).start()`` runs::

    python -m sglang_router.launch_router --host 127.0.0.1 --port P --worker-urls URL... \
        --policy manual --assignment-mode min_load --prometheus-host 127.0.0.1 --prometheus-port Q

plus ``--max-payload-size`` (the engines' body limit, ``MAX_PAYLOAD_BYTES``) and
``--disable-circuit-breaker`` (the breaker took a healthy engine out of rotation after ten refused
streamed requests of one client; dead engines are still dropped by the router's health check), and
waits until every worker is registered and healthy (``GET /workers``). At registration the
router calls ``/server_info`` and ``/model_info`` on each worker and probes it for gRPC with an
HTTP/2 preface; ``noria serve`` answers the first two and tolerates the probe. Start the router
after its workers are ready: a worker that answers 503 (loading) is registered late or not at all.
The router also loads the tokenizer from the workers' ``model_path``, so serve local folders.

With ``api_key`` (the run's per-run engine key), the router authenticates to its workers with it
and asks it of its own clients too; the key travels in the router's environment
(``NORIA_ROUTER_KEY``, appended to its arguments inside the process), never on its command line.

Each router gets its own Prometheus port (the router binds one, default 29000, and a second
router on the same port would fail). ``stop()`` sends SIGTERM and waits; the process renames itself
``sglang::router``, so find it by its ``noria.process.Child`` handle, not by name; it dies with the
process that started it.

Not guaranteed: the router counts load itself (requests it has in flight per worker); requests
sent to a worker directly are invisible to it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from noria.errors import NoriaError
from noria.net import free_port
from noria.process import Child


ROUTER_WITH_KEY = (
    "import os, sys; from sglang_router.launch_router import main; "
    "sys.argv[1:1] = ['--api-key=' + os.environ.pop('NORIA_ROUTER_KEY')]; main()"
)
"""The router's entry point with the API key taken from its environment."""


MAX_PAYLOAD_BYTES = 64 << 20
"""Largest request body the router accepts (``--max-payload-size``; its default is 512 MiB): the
engines' own limit (``noria.engine.server.app.BODY_BYTES``), so that a larger body is refused by the
router itself (413) rather than forwarded, and resent by the router's retries, to an engine that
cuts it off."""


class RouterError(NoriaError):
    """sglang-router is missing, exited, or did not become ready in time."""


class SglangRouter:
    """One sglang-router process with the manual policy in front of ``worker_urls``."""

    def __init__(
        self,
        worker_urls: Sequence[str],
        port: int | None = None,
        host: str = "127.0.0.1",
        assignment_mode: str = "min_load",
        policy: str = "manual",
        extra_args: Sequence[str] = (),
        log_path: str | Path | None = None,
        api_key: str | None = None,
    ) -> None:
        if not worker_urls:
            raise RouterError("sglang-router needs at least one worker URL")
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.host = host
        self.port = port or free_port(host)
        self.assignment_mode = assignment_mode
        self.policy = policy
        """``manual`` (session affinity by routing key) unless a benchmark asks for a load-based peer."""
        self.extra_args = list(extra_args)
        self.log_path = Path(log_path) if log_path else None
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.process: Child | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        launcher = ["-m", "sglang_router.launch_router"]
        if self.api_key:  # the key joins the arguments inside the process, out of sight of ps
            launcher = ["-c", ROUTER_WITH_KEY]
        return [
            sys.executable, *launcher,
            "--host", self.host, "--port", str(self.port),
            "--worker-urls", *self.worker_urls,
            "--policy", self.policy,
            *(["--assignment-mode", self.assignment_mode] if self.policy == "manual" else []),
            "--prometheus-host", self.host, "--prometheus-port", str(free_port(self.host)),
            "--max-payload-size", str(MAX_PAYLOAD_BYTES),
            # The router's circuit breaker counts an engine's 400 to a streamed request as the engine failing:
            # ten refused streamed requests from one client took a healthy engine out of rotation for a minute
            # (found by noria bench fuzz). A dead engine is still dropped by the router's health check, and the
            # launcher watches its engines itself (rollout.engine_restarts).
            "--disable-circuit-breaker",
            *self.extra_args,
        ]  # fmt: skip

    def start(self, timeout_s: float = 60.0) -> SglangRouter:
        """Launch the router and wait until all workers are registered and healthy."""
        try:
            import sglang_router  # noqa: F401 -- only to fail early with the install command
        except ImportError as e:
            raise RouterError("sglang-router is not installed: pip install sglang-router==0.3.2") from e
        env = {"HF_HUB_OFFLINE": "1"}  # never reach for a hub for a tokenizer
        if self.api_key:
            env["NORIA_ROUTER_KEY"] = self.api_key
        stdout = None if self.log_path else subprocess.DEVNULL
        self.process = Child.start(self.command(), name=f"sglang-router at {self.url}", log_path=self.log_path, env=env, stdout=stdout)
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RouterError(f"sglang-router exited with code {self.process.returncode} (log: {self.log_path})")
            try:
                workers = httpx.get(f"{self.url}/workers", headers=self.headers, timeout=2.0).json().get("workers", [])
                healthy = {w["url"].rstrip("/") for w in workers if w.get("is_healthy")}
                if healthy >= set(self.worker_urls):
                    return
                last = f"healthy workers: {sorted(healthy)}"
            except (httpx.HTTPError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(0.2)
        self.stop()
        raise RouterError(f"sglang-router at {self.url} not ready after {timeout_s} s ({last})")

    def workers(self) -> list[dict[str, Any]]:
        """The router's view of its workers (url, is_healthy, load)."""
        return httpx.get(f"{self.url}/workers", headers=self.headers, timeout=5.0).json()["workers"]

    def add_worker(self, url: str, timeout_s: float = 60.0) -> None:
        """Register one more worker (``POST /workers``) and wait until the router holds it healthy."""
        url = url.rstrip("/")
        body = {"url": url, **({"api_key": self.api_key} if self.api_key else {})}  # the key it talks to the worker with
        response = httpx.post(f"{self.url}/workers", json=body, headers=self.headers, timeout=10.0)
        if response.is_error:
            raise RouterError(f"sglang-router refused worker {url}: {response.status_code} {response.text[:300]}")
        self.worker_urls.append(url)
        self.wait_ready(timeout_s)

    def remove_worker(self, url: str) -> None:
        """Take a worker out of rotation (``DELETE /workers/{id}``); nothing if the router does not hold it."""
        url = url.rstrip("/")
        self.worker_urls = [u for u in self.worker_urls if u != url]
        for worker in self.workers():
            if worker["url"].rstrip("/") == url:
                response = httpx.delete(f"{self.url}/workers/{worker['id']}", headers=self.headers, timeout=10.0)
                if response.is_error and response.status_code != 404:  # 404: its removal is under way already
                    raise RouterError(f"sglang-router did not remove worker {url}: {response.status_code} {response.text[:300]}")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process is not None:
            self.process.stop(timeout_s)

    def __enter__(self) -> SglangRouter:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
