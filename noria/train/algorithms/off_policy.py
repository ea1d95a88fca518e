"""Off-policy corrections for the rollout engine's behaviour policy (training-inference mismatch).

The engine that sampled the tokens (logprobs ``rollout``) is not numerically the trainer (its
recompute at the start of the step, ``old``): different kernels, precision, a stale version in
async mode. A correction turns the ratio pi_old / pi_rollout into per-token weights that multiply
the policy loss. No gradient flows through them.

Contract: ``fn(cfg, old_logprobs [N], rollout_logprobs [N], loss_mask [N] bool, seq_index [N])
-> (weights [N], keep [N] bool)``; ``keep`` is False on tokens the correction masks (their weight
is 0). Values outside ``loss_mask`` are unspecified.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from noria.config import LossConfig
from noria.train.algorithms.registry import lookup, register
from noria.train.algorithms.segments import masked, segment_sum

CorrectionFn = Callable[[LossConfig, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
OFF_POLICY: dict[str, CorrectionFn] = {}
"""Off-policy corrections by name (``train.loss.off_policy``)."""

MAX_LOG_RATIO = 20.0
"""Log importance ratios are clamped to +-this before exponentiation."""


def register_off_policy(name: str) -> Callable[[CorrectionFn], CorrectionFn]:
    """Decorator registering an off-policy correction with the contract of this module."""
    return register(OFF_POLICY, "off-policy correction", name)


def get_off_policy(name: str) -> CorrectionFn:
    """The off-policy correction registered as ``name``."""
    return lookup(OFF_POLICY, "off-policy correction", name, "train.loss.off_policy")


def _all(mask: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(mask, dtype=torch.bool)


@register_off_policy("recompute")  # the same weights, chosen explicitly (asynchronous RL refuses "none")
@register_off_policy("none")
def no_correction(
    cfg: LossConfig, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, seq_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """w_t = 1: treat the engine as the trainer's own policy."""
    return torch.ones_like(old_logprobs), _all(loss_mask)


@register_off_policy("tis")
def tis(
    cfg: LossConfig, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, seq_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling: w_t = min(exp(old_t - rollout_t), is_cap).

    Reference: Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (2025).
    """
    log_ratio = (old_logprobs - rollout_logprobs).detach()
    weights = torch.exp(torch.clamp(log_ratio, min=-MAX_LOG_RATIO, max=math.log(cfg.is_cap)))
    return weights, _all(loss_mask)


@register_off_policy("mis")
def mis(
    cfg: LossConfig, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, seq_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked importance sampling (IcePop): w_t = r_t if mis_low <= r_t <= mis_high else 0, r_t = exp(old_t - rollout_t).

    Tokens outside the band are dropped from the gradient (they still count in the step's
    normaliser); kept tokens are reweighted by their ratio, IcePop's M(k) = k on [alpha, beta].
    Reference: Ling Team, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
    Thinking Model" (Ring-1T, 2025), IcePop.
    """
    ratio = torch.exp(torch.clamp((old_logprobs - rollout_logprobs).detach(), min=-MAX_LOG_RATIO, max=MAX_LOG_RATIO))
    keep = (ratio >= cfg.mis_low) & (ratio <= cfg.mis_high)
    return masked(ratio, keep), keep


@register_off_policy("seq_is")
def seq_is(
    cfg: LossConfig, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, seq_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level truncated IS: every token of sequence i gets w_i = min(exp(sum_t (old_t - rollout_t)), is_cap).

    The sum runs over the trained tokens of the sequence. Unbiased at the sequence level but the
    product of token ratios has high variance; the cap bounds it.
    Reference: Liu et al., "When Speed Kills Stability: Demystifying RL Collapse from the
    Training-Inference Mismatch" (2025).
    """
    log_ratio = masked((old_logprobs - rollout_logprobs).detach(), loss_mask)
    seq_log_ratio = segment_sum(log_ratio, seq_index)[seq_index.long()]
    weights = torch.exp(torch.clamp(seq_log_ratio, max=math.log(cfg.is_cap)))
    return weights, _all(loss_mask)
