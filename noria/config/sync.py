"""The ``sync`` section: weight sync from the trainer to the engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from noria.config.schema import ConfigError, option


@dataclass
class SyncConfig:
    """Weight sync from the trainer to the rollout engines. Owner: ``noria.sync`` (``build_sync``)."""

    transport: Literal["auto", "ipc", "broadcast", "disk"] = option(
        "auto",
        "ipc: in process or shared memory; broadcast: torch.distributed group from trainer rank 0 (gloo / NCCL); disk: "
        "safetensors folder the engine loads. auto, by where engines are: ipc on this machine (except from a GPU to "
        "another GPU: broadcast), disk for an engine on another machine, an external engine_url or vLLM.",
    )
    bucket_mb: int = option(256, "Tensors are sent in buckets of about this many MiB.")
    verify: bool = option(False, "After every update, compare a checksum of every engine tensor with the trainer's.")
    disk_dir: str | None = option(None, "disk transport: folder the weights are written to; null uses RUN_DIR/weights.")
    delta: bool = option(
        False,
        "disk transport: write only what changed since the last version (XOR, compressed, per-tensor checksums); an "
        "engine not serving that version, or refusing the delta, gets a full snapshot. noria engines only (SGLang and "
        "vLLM load full folders: refused at start). See docs/concepts.md.",
    )
    broadcast_backend: Literal["auto", "nccl", "gloo"] = option(
        "auto",
        "broadcast transport's group: nccl (CUDA weights, the engine on another GPU), gloo (any tensors; CUDA ones "
        "travel through host memory). auto: nccl when the trainer's weights are on CUDA, except gloo when the RL "
        "job's engine is on the trainer's own GPU (NCCL cannot hold two ranks on one GPU).",
    )

    def validate(self) -> None:
        if self.bucket_mb < 1:
            raise ConfigError(f"sync.bucket_mb must be >= 1, got {self.bucket_mb}")
        if self.delta and self.transport != "disk":
            raise ConfigError(f"sync.delta writes deltas to disk: it needs sync.transport: disk, not {self.transport}")
