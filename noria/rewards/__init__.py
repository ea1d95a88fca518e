"""Rewards: named scoring functions and the runner that applies them to samples.

- ``registry``: the built-in rewards by name (exact_match, numeric, math, format, countdown) and
  user functions by import path ``pkg.module:fn``; the reward function contract.
- ``runner``: ``score`` / ``score_async``: concurrent calls with a per-call timeout; failures mark
  the sample failed (never a silent 0) and are counted for metrics.
- ``model``, ``judge``, ``mixed``: a reward served by a model (``reward.model``): the generative
  judge's scorer, cache and engine; its prompt, request and verdict parsers; the rule and the judge
  weighted together, with each part, their agreement and the judge's latency counted.
- ``scalar``: a scalar (sequence-classification) reward model's input, classify request and score;
  ``shared``: a judge on the policy's own rollout engines, below rollout's priority.
"""

from noria.rewards.registry import REWARDS, get_reward, register_reward, resolve_reward
from noria.rewards.runner import ScoreCounts, score, score_async, score_groups, score_groups_async

__all__ = [
    "REWARDS",
    "ScoreCounts",
    "get_reward",
    "register_reward",
    "resolve_reward",
    "score",
    "score_async",
    "score_groups",
    "score_groups_async",
]
