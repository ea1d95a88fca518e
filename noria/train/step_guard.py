"""The end of an optimizer step: apply it, or skip it when it is not finite. One guard for every
trainer: the PyTorch backend (``noria.train.fsdp``, and the Megatron backend through it) and the
DiT trainer (``noria.diffusion.trainer``).

The caller decides ``finite`` (the loss and the gradient norm, agreed over every rank in a
distributed backend) and hands over its trainer, which keeps the counts a checkpoint saves:

- finite: the LR of the schedule (``lr_at`` of the applied steps) is set, the optimizer steps, the
  gradients are dropped, ``optimizer_steps`` grows by one and ``nonfinite_streak`` goes back to 0;
- not finite: the gradients are dropped, nothing is applied (weights, optimizer state and the
  schedule stay where they were) and ``nonfinite_streak`` grows; one more than
  ``train.max_nonfinite_skips`` in a row raises ``NonFiniteError``.
"""

from __future__ import annotations

from typing import Any, Protocol

from noria.train.backend import NonFiniteError
from noria.train.optim import lr_at, set_lr


class Steppable(Protocol):
    """What the guard reads and counts on a trainer."""

    cfg: Any
    """The trainer's ``TrainConfig`` (``optim`` and ``max_nonfinite_skips``)."""
    optimizer: Any
    optimizer_steps: int
    nonfinite_streak: int
    total_steps: int | None


def step_or_skip(trainer: Steppable, finite: bool, where: str = "") -> dict[str, float]:
    """Apply the step or skip it (see the module docstring); ``lr``, ``skipped`` and ``step``
    (applied steps so far) for the step's metrics. ``where`` words the error (e.g. `` on at least one rank``)."""
    lr = lr_at(trainer.optimizer_steps, trainer.cfg.optim, trainer.total_steps)
    if not finite:
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.nonfinite_streak += 1
        if trainer.nonfinite_streak > trainer.cfg.max_nonfinite_skips:
            raise NonFiniteError(
                f"step {trainer.optimizer_steps + 1}: non-finite loss or grad norm{where} "
                f"({trainer.nonfinite_streak} consecutive, train.max_nonfinite_skips is "
                f"{trainer.cfg.max_nonfinite_skips}); no update was applied"
            )
        return {"lr": lr, "skipped": 1.0, "step": float(trainer.optimizer_steps)}
    trainer.nonfinite_streak = 0
    set_lr(trainer.optimizer, lr)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.optimizer_steps += 1
    return {"lr": lr, "skipped": 0.0, "step": float(trainer.optimizer_steps)}
