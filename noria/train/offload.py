"""Optimizer state off the GPU while a colocated engine generates (``train.offload_optimizer``).

Colocated, the engine and the trainer share one GPU and take turns: during the trainer's turn the
engine pauses and frees its KV cache (``noria.launch.job.trainer_turn``); during the engine's turn
the trainer's weights must stay (the engine was just synced from them, and the next step starts
from them), but its optimizer state is idle until the next optimizer step. Adam keeps two fp32
moments per parameter (8 bytes, four times a bf16 model's weights; about 2 with
``train.optim.state_dtype: int8``, whose quantized moments and scales move alike): here they move to host memory when
the trainer's turn ends, before the engine takes its KV cache back, and return when the trainer's
turn begins, after the engine freed it. The engine's KV cache is sized when the engine starts, before
the first optimizer step creates the moments; without offload that memory is the trainer's again
from the first step on, so a colocated run must leave room for both.

The copies are exact (a tensor moved and moved back is the same bits), so offload changes no number
the trainer computes. Host copies go to pinned memory (asynchronous copies on the current
stream; the caching allocator reuses the freed GPU blocks in stream order, so the engine's KV
allocation after them is safe without a synchronisation). Hand-written rather than taken from a
library: FSDP2's ``CPUOffloadPolicy`` keeps parameters on the host and runs the optimizer there
(every step's update on the CPU), and the peers' offload code (verl, slime) is part of their own
trainers; this is the loop over ``optimizer.state`` that both do, about 30 lines.

Measured (``noria bench gpu-rl --set train.offload_optimizer=true`` against ``false``, one H100 80GB,
the bench's random Qwen3-0.6B-shaped model, the main job's recipe with int8 moments, 8 x 8 x 32):
1.21 GB moved out and back in 0.028 s a step (0.54 s the first time, pinned buffers being allocated),
1.5% of a 1.9 s step; the step took 2.10 s against 2.04 s (noise of that order between runs).

Not guaranteed: the offload time is on the critical path (no overlap with the engine's first
steps); a DTensor's state moves as its local shard (``DTensor.to``), unpinned.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class OptimizerOffload:
    """Moves ``optimizer``'s state tensors between its device and host memory; counts bytes and seconds."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.offloaded = False
        self.bytes = 0
        self.seconds = 0.0

    def offload(self) -> int:
        """State to host memory (pinned on CUDA); returns the bytes moved (0 when already there)."""
        if self.offloaded:
            return 0
        start, moved = time.perf_counter(), self._move(_to_host)
        self.offloaded, self.bytes = True, moved
        self.seconds += time.perf_counter() - start
        return moved

    def reload(self) -> int:
        """State back to the optimizer's device before the next step; returns the bytes moved."""
        if not self.offloaded:
            return 0
        start, moved = time.perf_counter(), self._move(lambda t: t.to(self.device, non_blocking=True))
        self.offloaded = False
        self.seconds += time.perf_counter() - start
        return moved

    def metrics(self) -> dict[str, float]:
        """``memory/optimizer_offloaded_gb`` (the state's size on the host while the engine generates)
        and ``time/optimizer_offload_s`` (both directions since the last call)."""
        out = {"memory/optimizer_offloaded_gb": self.bytes / 1e9, "time/optimizer_offload_s": self.seconds}
        self.seconds = 0.0
        return out

    def _move(self, to: Any) -> int:
        moved = 0
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:  # Adam's step counter is a 0-d tensor: it stays
                    state[key] = to(value)
                    moved += value.numel() * value.element_size()
        return moved


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda" or type(t) is not torch.Tensor:  # a DTensor moves its local shard, unpinned
        return t.to("cpu")
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def check_offload(config: Any) -> None:
    """``train.offload_optimizer`` where it can work (a run config's ``train`` and ``rollout``), else a
    ``ConfigError`` naming the keys."""
    from noria.config import ConfigError

    if not config.train.offload_optimizer:
        return
    if config.rollout.placement != "colocated":
        raise ConfigError("train.offload_optimizer frees GPU memory for an engine in the trainer's process: it needs "
                          f"rollout.placement: colocated (it is {config.rollout.placement})")
    if not str(config.train.device).startswith("cuda"):
        raise ConfigError(f"train.offload_optimizer moves the optimizer state off the GPU: it needs train.device: cuda "
                          f"(it is {config.train.device})")


def offload_for(config: Any, backend: Any) -> OptimizerOffload | None:
    """The job's offloader of ``backend``'s optimizer when ``train.offload_optimizer`` is on, else None."""
    if not config.train.offload_optimizer:
        return None
    return OptimizerOffload(backend.optimizer, backend.device)
