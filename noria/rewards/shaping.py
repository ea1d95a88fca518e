"""Reward shaping applied after scoring: DAPO's soft overlong punishment.

What this module owns: ``shape_overlong``, which adds a length penalty to each scored sample of a
group whose policy tokens run into the last ``reward.overlong_buffer_tokens`` of the generation
limit (``rollout.max_new_tokens``): 0 up to ``L - B`` tokens, then falling linearly to
``-reward.overlong_penalty`` at ``L`` (DAPO, eq. 13: a truncated answer is punished in proportion
to how far it ran into the buffer, instead of the cliff that the ``over_length`` filter or a failed
parse gives). The penalty is kept as its own part of the reward (``sample.metadata["rewards"]["overlong"]``,
``reward/component/overlong``), so the rule reward stays readable.

Single-turn rollouts only: a multi-turn episode's policy tokens are bounded per turn, so the run's
config check refuses the penalty with ``rollout.agent_fn`` or ``rollout.rollout_fn``.
"""

from __future__ import annotations

from typing import Any

from noria.types import Group, Status

TRAINABLE = (Status.COMPLETED, Status.TRUNCATED)


def overlong_penalty(tokens: int, limit: int, buffer: int, penalty: float) -> float:
    """The penalty of a response of ``tokens`` policy tokens: 0 up to ``limit - buffer``, then linear
    down to ``-penalty`` at ``limit`` (and beyond)."""
    start = limit - buffer
    if buffer <= 0 or tokens <= start:
        return 0.0
    return -penalty * min(tokens - start, buffer) / buffer


def shape_overlong(group: Group, counts: Any, limit: int, buffer: int, penalty: float) -> None:
    """Add each scored sample's overlong penalty to its reward, recorded as the ``overlong`` part."""
    for sample in group.samples:
        if sample.status not in TRAINABLE or sample.reward is None:
            continue
        value = overlong_penalty(sum(sample.loss_mask) if sample.loss_mask else len(sample.response_ids), limit, buffer, penalty)
        sample.reward += value
        sample.metadata.setdefault("rewards", {})["overlong"] = value
        counts.components.setdefault("overlong", []).append(value)
