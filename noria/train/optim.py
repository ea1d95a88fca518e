"""AdamW on fp32 master weights and the learning-rate schedule.

The moments are fp32 (``torch.optim.AdamW``) or, to save memory, bf16 or block-wise 8-bit
(``train.optim.state_dtype``; ``noria.train.compact_adamw``).

The schedule is a pure function of the number of applied optimizer steps (``lr_at``), so the only
schedule state a checkpoint needs is that step count: no LambdaLR with closures to pickle.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from noria.config import OptimConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over ``params`` (which must be fp32), its moments stored as ``cfg.state_dtype`` says."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters")
    if cfg.state_dtype != "float32":
        from noria.train.compact_adamw import CompactAdamW

        dtype = {"bfloat16": torch.bfloat16, "int8": torch.int8}[cfg.state_dtype]
        return CompactAdamW(
            params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, state_dtype=dtype
        )
    # CUDA tensors (not sharded DTensors): the fused kernel, one launch for all parameters instead
    # of the foreach path's several per group. DTensor is imported only then (with sympy, 0.4 s).
    fused = None
    if all(p.is_cuda for p in params):
        from torch.distributed.tensor import DTensor

        fused = not any(isinstance(p, DTensor) for p in params) or None
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused
    )


def lr_at(step: int, cfg: OptimConfig, total_steps: int | None) -> float:
    """Learning rate of the optimizer step that follows ``step`` applied steps (0-based).

    Linear warmup from lr / warmup_steps up to lr over ``warmup_steps`` steps, then constant, or a
    linear / cosine decay to ``min_lr_ratio * lr`` at ``total_steps``.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    total = cfg.total_steps or total_steps
    if total is None:
        raise ValueError(f"optim.schedule {cfg.schedule!r} needs optim.total_steps (or the run's step count)")
    span = max(total - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    if cfg.schedule == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr
