"""Overlong shaping (``noria.rewards.shaping``) and the length-bias figures of an asynchronous buffer:
DAPO's penalty is 0 before the buffer and falls linearly to -penalty at the limit, kept as its own
reward part; the config refuses a buffer past the limit and multi-turn plugins; the buffer reports
length and reward by staleness, and the length of groups dropped as stale, only when asynchronous."""

from __future__ import annotations

import asyncio

import pytest

from noria.config import load_config
from noria.config.schema import ConfigError
from noria.rewards.runner import ScoreCounts
from noria.rewards.shaping import overlong_penalty, shape_overlong
from noria.rollout.buffer import GroupBuffer
from noria.types import Group, Prompt, Sample, Status
from repo_util import ROOT

MAIN_JOB = ROOT / "examples" / "grpo_smollm2_arithmetic.yaml"


def sample(tokens: int, reward: float | None = 1.0, version: int = 0, status: Status = Status.COMPLETED) -> Sample:
    return Sample(prompt_ids=[1], response_ids=[7] * tokens, loss_mask=[1] * tokens, rollout_logprobs=[0.0] * tokens,
                  weight_versions=[version] * tokens, reward=reward, status=status)  # fmt: skip


def group(gid: int, lengths: list[int], rewards: list[float], version: int = 0) -> Group:
    return Group(group_id=gid, prompt=Prompt("p", "1", {}, gid), samples=tuple(sample(n, r, version) for n, r in zip(lengths, rewards)))


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


def test_an_asynchronous_buffer_reports_length_and_reward_by_staleness():
    async def run(max_staleness: int) -> tuple[int, dict[str, float]]:
        buffer = GroupBuffer(capacity=8, max_staleness=max_staleness)
        await buffer.put(group(0, [4, 6], [1.0, 0.0], version=3))  # staleness 0 at version 3
        await buffer.put(group(1, [10, 20], [0.0, 0.0], version=2))  # 1
        await buffer.put(group(2, [30, 50], [1.0, 1.0], version=0))  # 3: stale past 1, dropped
        taken = len(buffer.take(3, version=3))
        return taken, buffer.metrics(3)

    taken, m = asyncio.run(run(1))
    assert taken == 2
    assert m["buffer/by_staleness/0/response_len_mean"] == 5 and m["buffer/by_staleness/0/reward_mean"] == 0.5
    assert m["buffer/by_staleness/1/response_len_mean"] == 15 and m["buffer/by_staleness/1/reward_mean"] == 0.0
    assert m["buffer/stale_dropped_len_mean"] == 40 and "buffer/by_staleness/3/response_len_mean" not in m
    taken, sync = asyncio.run(run(0))
    assert taken == 1 and sync["buffer/dropped/stale"] == 2
    assert not any(k.startswith(("buffer/by_staleness", "buffer/stale_dropped")) for k in sync)  # synchronous: none
