"""The RL loss of one micro-batch, and the metrics that go with it.

How data moves: the backend computes, for one micro-batch of N packed tokens, the current
``logprobs`` (with gradient) and optionally the ``entropy``; it already holds ``old_logprobs`` (its
own recompute at the start of the step), the engine's ``rollout_logprobs``, per-token
``advantages``, ``loss_mask``, ``seq_index`` and optionally ``ref_logprobs``. ``rl_loss`` composes
the parts named in ``LossConfig`` (see ``noria.train.algorithms``):

    loss = agg(policy_loss * correction_weight) + kl_coef * agg(kl(lp, ref)) - entropy_coef * agg(entropy)

``agg`` divides by the step totals in ``LossNorm``, so the backend calls ``backward()`` on each
micro-batch's loss and SUMS gradients over micro-batches and ranks (see ``aggregation`` for the
rank caveat). Nothing here blocks on other ranks.

Metrics are ``name -> (sum, weight)`` pairs so they can be added over micro-batches and ranks:
- mean-type: report ``sum_total / weight_total`` (``loss`` and ``policy_loss`` carry the micro-batch's
  share of the step's trained tokens as weight, so the result is the step loss);
- extremum-type, names ending in ``_max`` or ``_min``: weight 0.0, the sum IS the extremum; combine
  with max (``_max``) or min (``_min``), never add. ``reduce_metrics`` does both; across ranks use
  all-reduce SUM for the pairs of mean-type names and MAX / MIN for the others.
A metric with nothing to measure in a micro-batch (no trained token, no kept token) is left out.

The names, all over trained tokens (loss_mask 1): ``loss``, ``policy_loss`` (the aggregated policy
term alone); ``clip_frac`` (and ``dual_clip_frac`` for ppo_clip); ``approx_kl``: k3 estimate of
KL(old || current); ``ref_kl``: the configured estimator of KL(current || reference), token mean;
``entropy``: token mean; ``is_weight_mean`` / ``_max`` / ``_min`` over the tokens the correction
keeps, ``is_masked_frac``; ``rollout_logprob_abs_diff`` (mean |old - rollout|) and its ``_max``;
``rollout_kl``: k3 estimate of KL(rollout || trainer), exp(d) - d - 1 with d = old - rollout.

Inputs must be finite; tokens outside the mask may hold any finite value (0 for prompt tokens).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from noria.config import LossConfig
from noria.train.algorithms import LossNorm, get_aggregation, get_kl, get_off_policy, get_policy_loss
from noria.train.algorithms.kl import k3
from noria.train.algorithms.segments import masked

__all__ = ["LossNorm", "reduce_metrics", "rl_loss"]

Metrics = dict[str, tuple[float, float]]


def rl_loss(
    cfg: LossConfig,
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
    norm: LossNorm,
    entropy: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """This micro-batch's share of the step loss (scalar, fp32) and its metrics.

    Every tensor is [N]: ``seq_index`` in 0..S-1 names each token's packed sequence (a sequence must
    not span micro-batches), ``loss_mask`` is 1.0 on trained tokens. Only ``logprobs`` and
    ``entropy`` carry gradients; the rest is detached here. ``ref_logprobs`` is required when
    ``kl_coef > 0``; given with ``kl_coef == 0`` it is only measured.
    """
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("rl_loss: train.loss.kl_coef > 0 needs ref_logprobs")
    mask = loss_mask > 0
    lp, old, rollout = logprobs.float(), old_logprobs.detach().float(), rollout_logprobs.detach().float()
    aggregate = get_aggregation(cfg.aggregation)
    per_token, policy_stats = get_policy_loss(cfg.policy_loss)(cfg, lp, old, advantages.detach().float(), mask, seq_index)
    weights, keep = get_off_policy(cfg.off_policy)(cfg, old, rollout, mask, seq_index)
    policy = aggregate(cfg, masked(per_token * weights, keep), mask, seq_index, norm)
    loss = policy
    means = dict(policy_stats)
    means["approx_kl"] = k3(old, lp.detach())  # KL(old || current), tokens sampled from (about) old
    if ref_logprobs is not None:
        kl = get_kl(cfg.kl_estimator)(lp if cfg.kl_coef > 0 else lp.detach(), ref_logprobs.detach().float())
        means["ref_kl"] = kl.detach()
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * aggregate(cfg, kl, mask, seq_index, norm)
    if entropy is not None:
        means["entropy"] = entropy.detach().float()
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * aggregate(cfg, entropy.float(), mask, seq_index, norm)
    return loss, _metrics(loss, policy, means, weights, keep, old, rollout, mask, norm)


def _metrics(
    loss: torch.Tensor,
    policy: torch.Tensor,
    means: dict[str, torch.Tensor],
    weights: torch.Tensor,
    keep: torch.Tensor,
    old: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    norm: LossNorm,
) -> Metrics:
    """(sum, weight) pairs over the trained tokens, read back to the host in one transfer."""
    abs_diff = masked(old - rollout, mask).abs()
    means = {**means, "rollout_logprob_abs_diff": abs_diff, "rollout_kl": k3(rollout, old), "is_masked_frac": (~keep).float()}
    kept = mask & keep
    n_tokens = mask.sum()
    share = n_tokens / max(float(norm.total_tokens), 1.0)  # shares add up to 1 over the step
    pairs = {k: (masked(v, mask).sum(), n_tokens) for k, v in means.items()}
    pairs["is_weight_mean"] = (masked(weights, kept).sum(), kept.sum())
    pairs["loss"] = (loss.detach(), share)
    pairs["policy_loss"] = (policy.detach(), share)
    pairs["rollout_logprob_abs_diff_max"] = _extreme(torch.amax, abs_diff, mask)
    pairs["is_weight_max"] = _extreme(torch.amax, weights, kept)
    pairs["is_weight_min"] = _extreme(torch.amin, weights, kept)
    return _to_host(pairs)


def _extreme(reduce, values: torch.Tensor, where: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max or min of ``values`` [N] where ``where`` [N] holds, number of such tokens)."""
    fill = float("-inf") if reduce is torch.amax else float("inf")
    return reduce(torch.where(where, values, values.new_tensor(fill))), where.sum()


def _to_host(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Metrics:
    """One device-to-host copy; drops metrics that measured nothing and gives extrema weight 0.0."""
    host = torch.stack([torch.stack([s.float(), w.float()]) for s, w in pairs.values()]).tolist()
    out: Metrics = {}
    for key, (value, weight) in zip(pairs, host):
        if weight > 0:
            out[key] = (value, 0.0 if key.endswith(("_max", "_min")) else weight)
    return out


def reduce_metrics(parts: Iterable[Metrics]) -> dict[str, float]:
    """Combine the metrics of several micro-batches (or ranks) into step values.

    Mean-type names: sum of sums / sum of weights. Names ending in ``_max`` / ``_min``: max / min.
    """
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for part in parts:
        for key, (value, weight) in part.items():
            if key.endswith("_max"):
                sums[key] = max(sums.get(key, value), value)
            elif key.endswith("_min"):
                sums[key] = min(sums.get(key, value), value)
            else:
                sums[key] = sums.get(key, 0.0) + value
                weights[key] = weights.get(key, 0.0) + weight
    return {k: (v / weights[k] if k in weights else v) for k, v in sums.items()}
