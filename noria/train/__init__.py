"""The trainer: turns packed rollouts into policy updates (backend, objective, packing, checkpoints).

Modules and what they own::

    backend.py     the contract every backend meets (TrainBackend), LossInputs / LossFn
    fsdp.py        the PyTorch backend: one process or FSDP2 (gloo on CPU, NCCL on CUDA)
    megatron/      the megatron-core backend (train.backend: megatron; CUDA, optional extra)
    packing.py     samples / groups -> TrainBatch -> token-budget micro-batches (per rank)
    logprobs.py    per-token logprobs and entropy from hidden states, in vocabulary-safe chunks
    checkpoint.py  DCP checkpoints committed by a marker; latest_checkpoint(run_dir)
    optim.py       AdamW and the LR schedule (a pure function of the step)
    losses.py      sft_loss and the RL objective adapted to LossInputs
    sft.py         multi-turn chat rows -> samples with assistant-only loss masks
    objective.py, algorithms/   the RL objective and its registries (advantages, losses, KL)

Typical use by the loop::

    backend = build_backend(run_cfg.train)           # FSDPBackend or MegatronBackend, by train.backend
    backend.init(model_folder, total_steps=n_steps)
    batch = pack_groups(groups, compute_advantages(cfg.loss, rewards))
    metrics = backend.train_step(batch)
"""

from __future__ import annotations

import importlib
from typing import Any

# Names re-exported here, by module. Imported on first use (PEP 562), so that the config sections
# living in this package (noria.train.megatron.config) load without the trainer, and noria.config
# can import them without a cycle.
_EXPORTS = {
    "noria.train.backend": ("LossFn", "LossInputs", "NonFiniteError", "TokenLogprobs", "TrainBackend", "TrainError"),
    "noria.train.checkpoint": ("CheckpointError", "checkpoint_dir", "latest_checkpoint"),
    "noria.train.fsdp": ("FSDPBackend", "init_distributed"),
    "noria.train.packing": ("pack_groups", "pack_samples"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        return getattr(importlib.import_module(_MODULE_OF[name]), name)
    raise AttributeError(f"module 'noria.train' has no attribute {name!r}")


def build_backend(cfg, **options):
    """The backend ``cfg.backend`` names (``TrainConfig``): ``FSDPBackend`` for single / fsdp2, the
    megatron-core one for megatron (refused with a clear error where it cannot run); ``options`` are
    the backends' shared keyword arguments (loss_fn, model_impl, seed, deterministic, temperature)."""
    if cfg.backend == "megatron":
        from noria.train.megatron.backend import MegatronBackend

        return MegatronBackend(cfg, **options)
    from noria.train.fsdp import FSDPBackend

    return FSDPBackend(cfg, **options)


__all__ = [*_MODULE_OF, "build_backend"]
