"""The objectives a backend can run, as :data:`~noria.train.backend.LossFn` values.

- ``sft_loss``: token-mean negative log-likelihood over masked tokens (``train.algorithm: sft``).
- ``rl_loss_fn(cfg)``: the RL objective of ``noria.train.objective.rl_loss`` (policy loss, KL,
  entropy, off-policy correction), fed one micro-batch at a time with step-wide normalisers.

Both divide by counts of the WHOLE step (``LossInputs.total_tokens``), so summing micro-batch
gradients gives the gradient of the full-batch loss whatever the split.
"""

from __future__ import annotations

import torch

from noria.config import TrainConfig
from noria.train.backend import LossFn, LossInputs, Metrics


def sft_loss(x: LossInputs) -> tuple[torch.Tensor, Metrics]:
    """Mean NLL over the step's loss tokens (this micro-batch's share of it)."""
    mask = x.batch.loss_mask
    nll_sum = -(x.logprobs * mask).sum()
    loss = nll_sum / max(x.total_tokens, 1.0)
    n = float(mask.sum())
    return loss, {"nll": (float(nll_sum.detach()), n)}


def rl_loss_fn(cfg: TrainConfig) -> LossFn:
    """The configured RL objective (``cfg.loss``) as a per-micro-batch loss."""
    from noria.train.objective import LossNorm, rl_loss

    def loss_fn(x: LossInputs) -> tuple[torch.Tensor, Metrics]:
        b = x.batch
        return rl_loss(
            cfg.loss,
            logprobs=x.logprobs,
            old_logprobs=x.old_logprobs,
            rollout_logprobs=b.rollout_logprobs,
            advantages=b.advantages,
            loss_mask=b.loss_mask,
            seq_index=x.seq_index,
            norm=LossNorm(total_tokens=x.total_tokens, total_seqs=x.total_seqs),
            entropy=x.entropy,
            ref_logprobs=x.ref_logprobs,
        )

    return loss_fn


def default_loss(cfg: TrainConfig) -> LossFn:
    """The loss ``train.algorithm`` names."""
    return sft_loss if cfg.algorithm == "sft" else rl_loss_fn(cfg)
