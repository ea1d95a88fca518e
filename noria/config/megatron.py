"""The ``train.megatron`` config section: parallelism and memory settings of the Megatron backend.

Owner: ``noria.train.megatron``; loading a config never imports megatron-core or the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from noria.config.schema import ConfigError, option


@dataclass
class MegatronConfig:
    """Parallelism and memory settings of ``train.backend: megatron`` (megatron-core). Owner:
    ``noria.train.megatron``. Ranks = train.world_size = tp * pp * cp * data-parallel ranks."""

    tp: int = option(1, "Tensor-parallel ranks (attention heads, MLP width and vocabulary split across them).")
    pp: int = option(1, "Pipeline-parallel stages; only 1 runs today (more is refused at start, naming this key).")
    cp: int = option(1, "Context-parallel ranks; only 1 runs today (megatron-core's CP attention needs Transformer Engine).")
    ep: int = option(1, "Expert-parallel ranks of MoE layers (experts split across them; divides the data-parallel size).")
    sequence_packing: bool = option(
        True, "Pack several sequences into each micro-batch up to train.micro_batch_tokens (THD layout, per-sequence "
        "attention); false runs one sequence per micro-batch.",
    )
    distributed_optimizer: bool = option(
        False, "Shard the fp32 master weights and Adam state across data-parallel ranks (Megatron's distributed optimizer)."
    )
    recompute: Literal["none", "selective", "full"] = option(
        "none", "Activation recomputation: selective (core attention), full (each layer); none keeps activations. "
        "train.activation_checkpointing true means full.",
    )

    def validate(self) -> None:
        for key in ("tp", "pp", "cp", "ep"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.megatron.{key} must be >= 1, got {getattr(self, key)}")

    def check_train(self, train) -> None:
        """With ``train.backend: megatron`` (``train`` is the TrainConfig): ``train.world_size`` splits into
        these groups (tp * pp * cp divides it, ep divides the data-parallel size), and no setting only the
        PyTorch backend implements is on."""
        world_size = train.world_size
        model = self.tp * self.pp * self.cp
        if world_size % model:
            raise ConfigError(f"train.world_size {world_size} is not a multiple of train.megatron tp*pp*cp = {model}")
        if (world_size // model) % self.ep:
            raise ConfigError(f"train.megatron.ep {self.ep} does not divide the data-parallel size {world_size // model}")
        for key, on in (("train.lora.enabled", train.lora.enabled), ("train.compile", train.compile)):
            if on:
                raise ConfigError(f"{key} needs train.backend single or fsdp2 (the Megatron backend does not implement it)")
