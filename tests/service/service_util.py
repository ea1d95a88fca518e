"""A real ``noria service`` process on a free loopback port, for the service tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from noria.net import free_port
from noria.service.client import ServiceClient, ServiceError, datum

REPO = Path(__file__).resolve().parents[2]
PROMPT = [11, 12, 13, 14, 15, 16]
PROBE = [datum(PROMPT, PROMPT[1:] + [17])]


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


def logprobs(trainer, data=PROBE) -> list[list[float]]:
    return [out["logprobs"]["data"] for out in trainer.forward(data).result()["loss_fn_outputs"]]


def target_data(target: int) -> list[dict]:
    return [datum(PROMPT, [target] * len(PROMPT))]


def train(trainer, data, steps: int, lr: float = 0.01) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step({"learning_rate": lr}).result()
        losses.append(fb.result()["metrics"]["loss:sum"])
    return losses


def check_samples_follow_the_adapter(alice: ServiceClient, bob: ServiceClient) -> None:
    """A tenant's samples: logprobs that its training client recomputes, from its current weights
    (moved by a step) or from weights saved for sampling (kept), which another tenant cannot reach."""
    trainer = alice.create_lora_training_client(rank=4)
    train(trainer, target_data(100), steps=2)
    drawn = trainer.sampling_client().sample(PROMPT, num_samples=2, sampling_params={"max_tokens": 5, "seed": 7}).result()
    for seq in drawn["sequences"]:
        assert (len(seq["tokens"]), seq["stop_reason"]) == (5, "length") or seq["stop_reason"] == "stop"
        tokens = PROMPT + seq["tokens"]
        recomputed = logprobs(trainer, [datum(tokens[:-1], tokens[1:])])[0][len(PROMPT) - 1 :]
        torch.testing.assert_close(torch.tensor(seq["logprobs"]), torch.tensor(recomputed), atol=1e-4, rtol=0)
    greedy = {"max_tokens": 5, "temperature": 0.0}
    now = trainer.sampling_client().sample(PROMPT, 1, greedy).result()["sequences"][0]
    saved = trainer.save_weights_and_get_sampling_client("two-steps")
    train(trainer, target_data(100), steps=1)  # the saved copy keeps the weights it was saved with
    later = saved.sample(PROMPT, 1, greedy).result()["sequences"][0]
    assert later["tokens"] == now["tokens"]
    torch.testing.assert_close(torch.tensor(later["logprobs"]), torch.tensor(now["logprobs"]), atol=1e-5, rtol=0)
    moved = trainer.sampling_client().sample(PROMPT, 1, greedy).result()["sequences"][0]
    assert moved["logprobs"] != now["logprobs"]
    assert moved["adapter_version"] > now["adapter_version"] >= 2, (now, moved)  # the versions that sampled them
    with pytest.raises(ServiceError) as err:
        bob.create_sampling_client(saved.model_path).sample(PROMPT)
    assert err.value.status == 404
