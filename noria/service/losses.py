"""Tinker's named losses over per-token logprobs, built on Noria's RL objective.

Each loss gets the current logprobs of the targets, ``lp`` [N] (every datum's tokens, concatenated;
``seq_index`` [N] names the datum), with gradient, and returns a scalar to minimise. As in Tinker,
losses are SUMS over tokens and datums (not means): the client scales by its own weights.

- ``cross_entropy``: ``-sum(weights * lp)`` (``weights`` default 1);
- ``importance_sampling``: ``-sum(exp(lp - logprobs) * advantages)``, ``logprobs`` being the
  sampler's; the policy-gradient estimator corrected for sampling from another policy;
- ``ppo``: ``-sum(min(r A, clip(r, clip_low_threshold, clip_high_threshold) A))``, r as above
  (thresholds from ``loss_fn_config``, default 0.8 and 1.2 as Tinker's).

The two policy losses are ``noria.train.objective.rl_loss`` with the ``ppo_clip`` policy loss (no
clip for importance sampling), no off-policy correction and the ``seq_mean_token_sum``
aggregation over one "sequence" count, which is the plain token sum Tinker defines. Log-ratios are
clamped to +-20 before ``exp`` (``noria.train.algorithms.policy``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from noria.config import LossConfig
from noria.service.wire import BadRequest

LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, dict], tuple[torch.Tensor, dict[str, float]]]


def cross_entropy(lp: torch.Tensor, inputs: dict[str, torch.Tensor], seq_index: torch.Tensor, config: dict) -> tuple[torch.Tensor, dict]:
    """Weighted negative log-likelihood of the targets, summed."""
    weights = inputs.get("weights", torch.ones_like(lp))
    loss = -(weights * lp).sum()
    return loss, {"loss:sum": float(loss.detach())}


def _policy_loss(clip_low: float, clip_high: float) -> LossFn:
    def loss_fn(lp: torch.Tensor, inputs: dict[str, torch.Tensor], seq_index: torch.Tensor, config: dict) -> tuple[torch.Tensor, dict]:
        from noria.train.objective import LossNorm, rl_loss

        low, high = clip_low, clip_high
        if "clip_low_threshold" in config or "clip_high_threshold" in config:
            if clip_low == float("inf"):
                raise BadRequest("loss_fn_config: importance_sampling takes no clip thresholds (use ppo)")
            low = 1.0 - float(config.get("clip_low_threshold", 1.0 - clip_low))
            high = float(config.get("clip_high_threshold", 1.0 + clip_high)) - 1.0
            if low < 0 or high < 0:
                raise BadRequest("loss_fn_config: need clip_low_threshold <= 1 <= clip_high_threshold")
        cfg = LossConfig(policy_loss="ppo_clip", clip_low=low, clip_high=high, aggregation="seq_mean_token_sum", off_policy="none")
        sampled = inputs["logprobs"].to(lp.device)
        loss, metrics = rl_loss(
            cfg, logprobs=lp, old_logprobs=sampled, rollout_logprobs=sampled, advantages=inputs["advantages"].to(lp.device),
            loss_mask=inputs.get("weights", torch.ones_like(lp)), seq_index=seq_index,
            norm=LossNorm(total_tokens=float(lp.numel()), total_seqs=1.0),
        )  # fmt: skip
        out = {"loss:sum": float(loss.detach())}
        if "clip_frac" in metrics and clip_low != float("inf"):
            value, weight = metrics["clip_frac"]
            out["clip_frac:mean"] = value / max(weight, 1.0)
        return loss, out

    return loss_fn


LOSSES: dict[str, tuple[LossFn, tuple[str, ...]]] = {
    "cross_entropy": (cross_entropy, ()),
    "importance_sampling": (_policy_loss(float("inf"), float("inf")), ("logprobs", "advantages")),
    "ppo": (_policy_loss(0.2, 0.2), ("logprobs", "advantages")),
}
"""Loss name -> (function, the loss inputs it needs besides target_tokens)."""


def get_loss(name: object) -> tuple[LossFn, tuple[str, ...]]:
    """The loss Tinker calls ``name``; a ``BadRequest`` naming the known ones otherwise."""
    if name not in LOSSES:
        raise BadRequest(f"loss_fn {name!r}: known losses are {sorted(LOSSES)}")
    return LOSSES[name]
