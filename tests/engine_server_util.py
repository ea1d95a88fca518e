"""Helpers for the engine server tests: a real ``noria serve`` subprocess on a free loopback port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from noria.net import free_port

REPO = Path(__file__).resolve().parents[1]


class ServeProcess:
    """``python -m noria.cli serve`` on 127.0.0.1; ``statuses`` records what /health said while starting."""

    def __init__(self, model_dir: Path, *args: str, log_dir: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "noria.cli", "serve", "--model", str(model_dir), "--port", str(self.port)]
        cmd += ["--engine.kv_cache_tokens", "8192", *args]
        self.log_path = (log_dir or Path("/tmp")) / f"noria-serve-{self.port}.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115
        env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.statuses: list[int] = []
        self.generate_while_loading: int | None = None

    def wait_ready(self, timeout_s: float = 90.0, headers: dict | None = None) -> ServeProcess:
        """Poll /health as fast as possible; while it says 503, also try /generate once."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"noria serve exited with {self.process.returncode}: {self.read_log()}")
            try:
                status = httpx.get(f"{self.url}/health", headers=headers, timeout=5).status_code
            except httpx.TransportError:
                time.sleep(0.02)
                continue
            self.statuses.append(status)
            if status == 503 and self.generate_while_loading is None:
                self.generate_while_loading = httpx.post(
                    f"{self.url}/generate", json={"input_ids": [5]}, headers=headers, timeout=5
                ).status_code
            if status == 200:
                return self
            time.sleep(0.02)
        raise TimeoutError(f"noria serve not ready after {timeout_s} s: {self.read_log()}")

    def read_log(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self) -> int:
        self.terminate()
        try:
            code = self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self.log.close()
        return code


def routed_engines(model_dir, logs: Path, count: int = 2):
    """Generator for a fixture: ``count`` ``noria serve`` engines behind the real sglang-router,
    yielding ``(router, engines)`` and stopping them all afterwards."""
    from noria.router.sglang_router import SglangRouter

    engines = [ServeProcess(model_dir, "--engine-id", f"engine-{i}", log_dir=logs) for i in range(count)]
    router = None
    try:
        for e in engines:
            e.wait_ready()
        router = SglangRouter([e.url for e in engines], log_path=logs / "router.log").start(timeout_s=60)
        yield router, engines
    finally:
        if router is not None:
            router.stop()
        for e in engines:
            e.stop()


def rss_mb(pid: int) -> float:
    """The resident memory of process ``pid``, in MiB (Linux)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def deflate_among_good_codes(url: str, body: bytes, headers: dict[str, str] | None = None, n: int = 96) -> list[int]:
    """Status codes of ``n`` POSTs of ``body`` to ``url``, 24 at a time on one client, every odd one
    sent ``Content-Encoding: deflate`` (``noria.net.deflate_body``); an unanswered one raises
    httpx.ReadTimeout, and a connection left blocked by an unread body stalls the ones after it."""
    import asyncio

    async with httpx.AsyncClient(timeout=30) as client:
        async def one(i: int) -> int:
            sent = {"Content-Type": "application/json", **(headers or {}), "Content-Encoding": "deflate" if i % 2 else "identity"}
            return (await client.post(url, content=body, headers=sent)).status_code

        codes = []
        for start in range(0, n, 24):
            codes += await asyncio.gather(*(one(i) for i in range(start, start + 24)))
        return codes


async def split_deflate_status(url: str, headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> int | None:
    """The status a server answers a deflate POST whose 2-byte body comes 0.3 s after its headers (the
    case aiohttp leaves unanswered, ``noria.net.deflate_body``): None if no answer came in ``timeout_s``,
    0 if the connection was closed without one."""
    import asyncio
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    writer.write((f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                  f"Content-Encoding: deflate\r\nContent-Length: 2\r\n{extra}\r\n").encode())  # fmt: skip
    try:
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.write(b"{}")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    except asyncio.TimeoutError:
        return None
    except ConnectionError:
        return 0
    finally:
        writer.close()
    return int(line.split()[1]) if line else 0
