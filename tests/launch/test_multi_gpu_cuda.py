"""Asynchronous RL with the engine and the trainer on separate devices, on CUDA (issue 10).

Two GPUs: the ``noria serve`` engine on cuda:0 (``rollout.engine_device``), the trainer on cuda:1
(``train.device``), weights over an NCCL broadcast group. One GPU: both on cuda:0 in two processes,
weights over gloo (NCCL refuses two ranks on one GPU), the engine receiving CUDA tensors. Every push
is verified (``sync.verify``: the engine's checksum of every tensor equals the trainer's), so a run
that finishes moved the weights bit for bit. Skipped without the GPUs each case needs.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from noria.config import load_config
from noria.process.env import MULTICAST_OFF
from noria.launch.job import LocalJob
from noria.loop import rl_loop
from rl_util import async_args, read_jsonl

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_async(model, run_dir, engine: str, trainer: str) -> tuple[list[dict], str, torch.device, torch.device]:
    args = {"rollout.engine_device": engine, "train.device": trainer, "sync.transport": "broadcast", "sync.verify": True,
            "train.max_steps": 3, "rollout.max_staleness": 1}  # fmt: skip
    job = LocalJob.build(load_config(None, async_args(model, **args)), str(run_dir), None, False)
    try:
        asyncio.run(job.run(rl_loop))
        backend = job.sync.transport_impl.backend
        weights = next(job.backend.lm.parameters()).device
        environ = open(f"/proc/{job.engine_process.pid}/environ").read().split("\0")
    finally:
        job.close()
    assert all(f"{k}={v}" in environ for k, v in MULTICAST_OFF.items())
    return read_jsonl(run_dir / "metrics.jsonl"), backend, weights, torch.device(trainer)


def check_rows(rows: list[dict]) -> None:
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert all(r["buffer/staleness_max"] <= 1 and r["sync/gb_per_s"] > 0 and r["sync/bytes"] > 0 for r in rows)


@pytest.mark.skipif(GPUS < 2, reason="engine and trainer on separate GPUs need two")
def test_async_engine_on_gpu0_trainer_on_gpu1_nccl(tiny_model_dir, tmp_path):
    rows, backend, weights, trainer = run_async(tiny_model_dir, tmp_path / "run", "cuda:0", "cuda:1")
    check_rows(rows)
    assert backend == "nccl" and weights == trainer == torch.device("cuda", 1)


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_async_engine_and_trainer_processes_on_one_gpu_gloo(tiny_model_dir, tmp_path):
    rows, backend, weights, trainer = run_async(tiny_model_dir, tmp_path / "run", "cuda:0", "cuda:0")
    check_rows(rows)
    assert backend == "gloo" and weights == trainer
