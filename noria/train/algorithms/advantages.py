"""Advantage estimators: outcome rewards of a step's groups -> one advantage per sample, and GAE.

Outcome estimators take every group of ONE optimizer step at once, ``rewards[g][i]`` being the
scalar reward of sample i of group g, and return the same nesting. Batch-level estimators
(REINFORCE++) normalise over everything passed in, so pass the whole step, not a micro-batch.

Failed samples (status FAILED, reward None) must be removed by the caller BEFORE this call: a
failure is not a zero reward, and keeping it would move the group's baseline. A group that is left
with a single sample has no baseline to compare against; the group estimators give it advantage 0.

Standard deviations are the unbiased (n - 1) estimate, as in TRL and verl, and ``EPS`` keeps the
division finite when every reward of a group is equal (those samples then get advantage 0).

GAE is a separate pure function over token rewards and values; the value model (critic) that
produces those values is ``noria.train.critic`` (PPO with ``train.loss.advantage: gae``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from noria.config import LossConfig
from noria.train.algorithms.registry import UnknownAlgorithmError, lookup, register

EPS = 1e-6
"""Added to a standard deviation before dividing by it."""

AdvantageFn = Callable[[LossConfig, list[list[float]]], list[list[float]]]
ADVANTAGES: dict[str, AdvantageFn] = {}
"""Outcome-reward advantage estimators by name (``train.loss.advantage``)."""


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering an advantage estimator ``fn(cfg, rewards) -> advantages``."""
    return register(ADVANTAGES, "advantage estimator", name)


def compute_advantages(cfg: LossConfig, rewards: list[list[float]]) -> list[list[float]]:
    """Advantages with the estimator ``cfg.advantage``: one list per group, one value per sample.

    ``rewards`` holds the groups of one whole optimizer step, failed samples already excluded.
    """
    if cfg.advantage == "gae":
        raise UnknownAlgorithmError(
            "train.loss.advantage: 'gae' needs per-token values from the critic, not group rewards: the RL job "
            "runs it through noria.train.critic.ppo_train (or call noria.train.algorithms.gae directly); "
            f"outcome estimators here: {', '.join(sorted(ADVANTAGES))}"
        )
    return lookup(ADVANTAGES, "advantage estimator", cfg.advantage, "train.loss.advantage")(cfg, rewards)


def check_advantage_name(name: str) -> None:
    """Raise ``UnknownAlgorithmError`` unless ``name`` is a registered estimator or ``gae`` (the critic's)."""
    if name != "gae":
        lookup({**ADVANTAGES, "gae": gae}, "advantage estimator", name, "train.loss.advantage")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _std(xs: list[float]) -> float:
    """Unbiased standard deviation; 0 for fewer than two values."""
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _centre(group: list[float]) -> list[float]:
    """r_i - mean(r); a group of one sample gets 0."""
    if len(group) < 2:
        return [0.0] * len(group)
    m = _mean(group)
    return [r - m for r in group]


def _whiten_all(groups: list[list[float]]) -> list[list[float]]:
    """(x - mean) / (std + EPS) with mean and std over every sample of every group."""
    flat = [x for g in groups for x in g]
    if len(flat) < 2:
        return [[0.0] * len(g) for g in groups]
    m, s = _mean(flat), _std(flat)
    return [[(x - m) / (s + EPS) for x in g] for g in groups]


@register_advantage("grpo")
def grpo(cfg: LossConfig, rewards: list[list[float]]) -> list[list[float]]:
    """GRPO group-relative advantage: A_i = (r_i - mean(r)) / (std(r) + eps), or r_i - mean(r) without ``normalize_std``.

    Reference: Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
    Language Models" (2024).
    """
    out = []
    for group in rewards:
        centred = _centre(group)
        scale = _std(group) + EPS if cfg.normalize_std else 1.0
        out.append([a / scale for a in centred])
    return out


@register_advantage("dr_grpo")
def dr_grpo(cfg: LossConfig, rewards: list[list[float]]) -> list[list[float]]:
    """Dr.GRPO advantage: A_i = r_i - mean(r), never divided by the std (``normalize_std`` is ignored).

    The paper's other half, dropping GRPO's 1/|o_i| length normalisation, is the aggregation:
    set ``train.loss.aggregation: seq_mean_token_sum`` and ``train.loss.seq_sum_divisor`` to a
    constant such as the maximum response length (the paper's choice), so each sequence's token sum
    is divided by the same number whatever its length.

    Reference: Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective" (2025).
    """
    return [_centre(group) for group in rewards]


@register_advantage("rloo")
def rloo(cfg: LossConfig, rewards: list[list[float]]) -> list[list[float]]:
    """RLOO leave-one-out baseline: A_i = r_i - (sum_j r_j - r_i) / (n - 1).

    Reference: Kool et al., "Buy 4 REINFORCE Samples, Get a Baseline for Free!" (2019); Ahmadian et
    al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in
    LLMs" (2024).
    """
    out = []
    for group in rewards:
        n, total = len(group), sum(group)
        out.append([r - (total - r) / (n - 1) for r in group] if n > 1 else [0.0] * n)
    return out


@register_advantage("reinforce_pp")
def reinforce_pp(cfg: LossConfig, rewards: list[list[float]]) -> list[list[float]]:
    """REINFORCE++: no group baseline; returns normalised over the whole batch, A_i = (r_i - mean_B) / (std_B + eps).

    With one outcome reward per sample the return is the reward (no per-token discounting here).
    The batch statistics are over samples, not tokens (verl whitens over tokens, weighting long
    responses more).

    Reference: Hu, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models" (2025).
    """
    return _whiten_all(rewards)


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline(cfg: LossConfig, rewards: list[list[float]]) -> list[list[float]]:
    """REINFORCE++ with baseline: subtract the group mean, then normalise over the whole batch.

    A_i = (a_i - mean_B(a)) / (std_B(a) + eps) with a_i = r_i - mean_group(r).

    Reference: Hu, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models"
    (2025), the group-baseline variant for reasoning tasks.
    """
    return _whiten_all([_centre(group) for group in rewards])


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the last dimension; no gradient flows.

    Shapes: ``token_rewards`` [..., T]; ``values`` [..., T+1] (the last entry bootstraps a truncated
    response) or [..., T] (the response ended: the value after it is 0); ``mask`` [..., T], 1 on policy
    tokens. Returns ``(advantages [..., T], returns [..., T])``, both 0 where ``mask`` is 0.

        delta_t = r_t + gamma * V_{t+1} - V_t,    A_t = delta_t + gamma * lam * A_{t+1},    R_t = A_t + V_t

    where t+1 is the next POLICY token: masked tokens (tool or environment output) are skipped, their
    rewards and values ignored, as verl does for multi-turn rollouts. Whitening the advantages is
    left to the caller.

    Reference: Schulman et al., "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation" (2016).
    """
    rewards, keep = token_rewards.detach().float(), mask.detach() > 0
    length = rewards.shape[-1]
    values = _values_with_bootstrap(values.detach().float(), length)
    next_value, running = values[..., length], torch.zeros_like(values[..., 0])
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(length)):
        delta = rewards[..., t] + gamma * next_value - values[..., t]
        step = delta + gamma * lam * running
        running = torch.where(keep[..., t], step, running)
        next_value = torch.where(keep[..., t], values[..., t], next_value)
        advantages[..., t] = torch.where(keep[..., t], step, torch.zeros_like(step))
    returns = torch.where(keep, advantages + values[..., :length], torch.zeros_like(advantages))
    return advantages, returns


def _values_with_bootstrap(values: torch.Tensor, length: int) -> torch.Tensor:
    """Values [..., T] or [..., T+1] -> [..., T+1], appending a terminal 0 when none is given."""
    if values.shape[-1] == length + 1:
        return values
    if values.shape[-1] == length:
        return torch.cat([values, torch.zeros_like(values[..., :1])], dim=-1)
    raise ValueError(f"gae: values must have T or T+1 entries on the last dimension (T={length}), got {values.shape[-1]}")
