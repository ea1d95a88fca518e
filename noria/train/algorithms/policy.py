"""Policy losses: per-token surrogate losses to MINIMISE, from current and old logprobs and advantages.

Contract, for one micro-batch of N packed tokens:
``fn(cfg, logprobs [N], old_logprobs [N], advantages [N], loss_mask [N], seq_index [N]) -> (loss [N], stats)``.
``logprobs`` carries the gradient; ``old_logprobs`` are the trainer's own recompute at the start of
the step (no gradient). ``loss_mask`` is bool. Values outside the mask are unspecified (the
aggregation drops them). ``stats`` maps a name to per-token values [N] whose mean over the masked
tokens is the statistic (e.g. ``clip_frac``: 1.0 on tokens whose gradient a clip removed).

Log-ratios are clamped to [-20, 20] before ``exp`` (as verl does) so a garbage logprob outside the
mask cannot overflow into a NaN gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from noria.config import LossConfig
from noria.train.algorithms.registry import lookup, register
from noria.train.algorithms.segments import segment_mean

Stats = dict[str, torch.Tensor]
PolicyLossFn = Callable[
    [LossConfig, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, Stats]
]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}
"""Policy losses by name (``train.loss.policy_loss``)."""

MAX_LOG_RATIO = 20.0
"""Log importance ratios are clamped to +-this before exponentiation."""


ADVANTAGE_SCALED: set[str] = set()
"""Policy losses whose every token's term is a multiple of that token's advantage: a sample whose
advantage is 0 everywhere has no gradient from them, so ``train.skip_zero_advantage`` may leave it
out of the forward (``noria.train.rl_step.pack_step``). A loss is in it only if registered with
``advantage_scaled=True``; every other loss trains every sample."""


def register_policy_loss(name: str, advantage_scaled: bool = False) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss with the contract of this module (``advantage_scaled``:
    see :data:`ADVANTAGE_SCALED`)."""
    if advantage_scaled:
        ADVANTAGE_SCALED.add(name)
    return register(POLICY_LOSSES, "policy loss", name)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name``."""
    return lookup(POLICY_LOSSES, "policy loss", name, "train.loss.policy_loss")


def _log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """log(pi / pi_old) per token [N], clamped to +-MAX_LOG_RATIO."""
    return torch.clamp(logprobs - old_logprobs, min=-MAX_LOG_RATIO, max=MAX_LOG_RATIO)


def _clipped_surrogate(cfg: LossConfig, ratio: torch.Tensor, advantages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) per token, and where the clipped branch won [N] bool."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@register_policy_loss("ppo_clip", advantage_scaled=True)
def ppo_clip(
    cfg: LossConfig,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
) -> tuple[torch.Tensor, Stats]:
    """PPO clipped surrogate with asymmetric clip range and optional dual clip; shapes [N].

        r = exp(lp - old),  L = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
        dual clip (c = cfg.dual_clip, only where A < 0):  L = min(L, -c A)

    The dual clip caps the loss of a negative-advantage token whose ratio has grown huge at c |A|,
    with zero gradient there. Stats: ``clip_frac`` (either clip removed the gradient),
    ``dual_clip_frac``.

    References: Schulman et al., "Proximal Policy Optimization Algorithms" (2017); clip-higher from
    Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (2025); dual clip
    from Ye et al., "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning" (2020).
    """
    ratio = torch.exp(_log_ratio(logprobs, old_logprobs))
    loss, clipped = _clipped_surrogate(cfg, ratio, advantages)
    dual = torch.zeros_like(clipped)
    if cfg.dual_clip is not None:
        bound = -cfg.dual_clip * advantages
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    return loss, {"clip_frac": (clipped | dual).float(), "dual_clip_frac": dual.float()}


@register_policy_loss("gspo", advantage_scaled=True)
def gspo(
    cfg: LossConfig,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
) -> tuple[torch.Tensor, Stats]:
    """GSPO: PPO clipping on a length-normalised SEQUENCE ratio, in the paper's token-level form; shapes [N].

        s_i = exp(mean over the masked tokens t of sequence i of (lp_t - old_t))
        s_i,t = sg[s_i] * exp(lp_t - sg[lp_t])          (value s_i, gradient s_i * grad lp_t)
        L_t = max(-A_t s_i,t, -A_t clip(s_i,t, 1 - clip_low, 1 + clip_high))

    With one advantage per sequence and ``aggregation: seq_mean_token_mean`` the gradient equals
    that of the sequence objective mean_i max(-A_i s_i, -A_i clip(s_i, ...)). The paper's clip range
    is tiny (clip_low 3e-4, clip_high 4e-4): set it, the PPO defaults clip almost nothing here.
    ``dual_clip`` does not apply. Stats: ``clip_frac`` (tokens of clipped sequences).

    Reference: Zheng et al., "Group Sequence Policy Optimization" (2025), GSPO-token.
    """
    seq_log_ratio = segment_mean(_log_ratio(logprobs, old_logprobs).detach(), loss_mask, seq_index)
    seq_ratio = torch.exp(torch.clamp(seq_log_ratio, min=-MAX_LOG_RATIO, max=MAX_LOG_RATIO))
    token_ratio = seq_ratio * torch.exp(logprobs - logprobs.detach())
    loss, clipped = _clipped_surrogate(cfg, token_ratio, advantages)
    return loss, {"clip_frac": clipped.float()}


@register_policy_loss("cispo", advantage_scaled=True)
def cispo(
    cfg: LossConfig,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
) -> tuple[torch.Tensor, Stats]:
    """CISPO: clip the importance weight, not the update; every token keeps a gradient. Shapes [N].

        L_t = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] * A_t * lp_t,   r_t = exp(lp_t - old_t)

    The loss VALUE is a REINFORCE-style surrogate (it contains lp, not the ratio), so it is not
    comparable with ppo_clip's; its gradient is clip(r) A grad lp. The paper effectively disables
    the lower bound (a large clip_low) and tunes clip_high. Stats: ``clip_frac`` (weight clipped).

    Reference: MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention" (2025).
    """
    ratio = torch.exp(_log_ratio(logprobs, old_logprobs)).detach()
    weight = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss = -weight * advantages * logprobs
    clipped = (ratio < 1.0 - cfg.clip_low) | (ratio > 1.0 + cfg.clip_high)
    return loss, {"clip_frac": clipped.float()}
