"""Overlong shaping (``noria.rewards.shaping``): DAPO's penalty is 0 before the buffer and falls
linearly to -penalty at the limit, kept as its own reward part; the config refuses a buffer past the
limit and multi-turn plugins."""

from __future__ import annotations

import pytest

from noria.config import load_config
from noria.config.schema import ConfigError
from noria.rewards.runner import ScoreCounts
from noria.rewards.shaping import overlong_penalty, shape_overlong
from noria.types import Group, Prompt, Sample, Status
from repo_util import ROOT

MAIN_JOB = ROOT / "examples" / "grpo_smollm2_arithmetic.yaml"


def sample(tokens: int, reward: float | None = 1.0, version: int = 0, status: Status = Status.COMPLETED) -> Sample:
    return Sample(prompt_ids=[1], response_ids=[7] * tokens, loss_mask=[1] * tokens, rollout_logprobs=[0.0] * tokens,
                  weight_versions=[version] * tokens, reward=reward, status=status)  # fmt: skip


def test_the_penalty_is_zero_before_the_buffer_then_linear_to_the_limit():
    assert [overlong_penalty(t, 32, 8, 1.0) for t in (0, 24, 26, 28, 32, 40)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(30, 32, 8, 0.5) == -0.375
    assert overlong_penalty(32, 32, 0, 1.0) == 0.0  # buffer 0: off


def test_shaping_adds_the_penalty_as_its_own_reward_part():
    g = Group(group_id=0, prompt=Prompt("p", "1", {}, 0),
              samples=(sample(10, 1.0), sample(32, 1.0), sample(30, 0.0), sample(32, None, status=Status.FAILED)))  # fmt: skip
    counts = ScoreCounts()
    shape_overlong(g, counts, limit=32, buffer=8, penalty=1.0)
    assert [s.reward for s in g.samples] == [1.0, 0.0, -0.75, None]
    assert [s.metadata.get("rewards", {}).get("overlong") for s in g.samples] == [0.0, -1.0, -0.75, None]
    assert counts.components["overlong"] == [0.0, -1.0, -0.75]


@pytest.mark.parametrize("overrides, message", [
    (["--reward.overlong_buffer_tokens", "64"], r"must not exceed rollout.max_new_tokens \(32\)"),
    (["--reward.overlong_buffer_tokens", "8", "--rollout.agent_fn", "noria.bench.soak:soak_agent"], "rollout.agent_fn is set"),
    (["--reward.overlong_penalty", "-1"], "must be >= 0"),
])  # fmt: skip
def test_the_config_refuses_what_shaping_cannot_do(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(MAIN_JOB, overrides)
    assert load_config(MAIN_JOB, ["--reward.overlong_buffer_tokens", "8"]).reward.overlong_buffer_tokens == 8
