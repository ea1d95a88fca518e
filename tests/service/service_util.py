"""A real ``noria service`` process on a free loopback port, for the service tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from noria.net import free_port

REPO = Path(__file__).resolve().parents[2]


class ServiceProcess:
    """``python -m noria.cli service`` on 127.0.0.1 with a keys file and a state folder (fp32)."""

    def __init__(self, model_dir: Path, keys_file: Path, state_dir: Path, log_dir: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "noria.cli", "service", "--model", str(model_dir), "--port", str(self.port),
               "--model.dtype", "float32", "--engine.kv_cache_tokens", "4096", "--service.keys_file", str(keys_file), "--service.state_dir", str(state_dir), *args]  # fmt: skip
        self.log_path = log_dir / f"noria-service-{self.port}.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115
        env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "2"}
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def wait_ready(self, timeout_s: float = 120.0) -> ServiceProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"noria service exited with {self.process.returncode}: {self.read_log()}")
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"noria service not ready after {timeout_s} s: {self.read_log()}")

    def read_log(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self.log.close()
        return code
