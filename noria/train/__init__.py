"""The trainer: turns packed rollouts into policy updates (backend, objective, packing, checkpoints).

Modules and what they own::

    backend.py     the contract every backend meets (TrainBackend), LossInputs / LossFn
    fsdp.py        the PyTorch backend: one process or FSDP2 (gloo on CPU, NCCL on CUDA)
    packed_forward.py  a packed batch -> hidden states -> per-token logprobs (LogprobModel)
    step_metrics.py, step_guard.py   a step's (sum, weight) metrics; its optimizer step or skip
    weights_out.py rank 0's sync buckets and HF folder (FSDP2 and Megatron alike)
    megatron/      the megatron-core backend (train.backend: megatron; CUDA, optional extra)
    packing.py     samples / groups -> TrainBatch -> token-budget micro-batches (per rank)
    prefix_tree.py a batch's token trie: tokens sequences share go through the model once
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

from noria.train.backend import LossFn, LossInputs, NonFiniteError, TokenLogprobs, TrainBackend, TrainError
from noria.train.checkpoint import CheckpointError, checkpoint_dir, latest_checkpoint
from noria.train.fsdp import FSDPBackend, init_distributed
from noria.train.packing import pack_groups, pack_samples


def build_backend(cfg, **options):
    """The backend ``cfg.backend`` names (``TrainConfig``): ``FSDPBackend`` for single / fsdp2, the
    megatron-core one for megatron (refused with a clear error where it cannot run); ``options`` are
    the backends' shared keyword arguments (loss_fn, model_impl, seed, deterministic, temperature)."""
    if cfg.backend == "megatron":
        from noria.train.megatron.backend import MegatronBackend

        return MegatronBackend(cfg, **options)
    from noria.train.fsdp import FSDPBackend

    return FSDPBackend(cfg, **options)


__all__ = [
    "CheckpointError", "FSDPBackend", "LossFn", "LossInputs", "NonFiniteError", "TokenLogprobs", "TrainBackend",
    "TrainError", "build_backend", "checkpoint_dir", "init_distributed", "latest_checkpoint", "pack_groups", "pack_samples",
]  # fmt: skip
