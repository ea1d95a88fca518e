"""Each sample is scored as soon as it finishes (``reward.score_each_sample``), on the real engine and
scheduler: the rewards are those of scoring the whole group at the end, and the scoring that ran
while the group's slowest sample still generated is counted as hidden (none when scoring per group).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from noria.config import EngineConfig, RewardConfig, RolloutConfig
from noria.engine import Engine
from noria.models import load_model, load_tokenizer
from noria.rollout import LocalEngineClient, RolloutContext
from noria.rollout.buffer import GroupBuffer
from noria.rollout.generate import generate_one
from noria.rollout.scheduler import RolloutScheduler
from noria.types import Prompt
from toy_rewards import digits


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = Engine(load_model(tiny_model_dir, dtype=torch.float32), load_tokenizer(tiny_model_dir), EngineConfig(kv_cache_tokens=2048), seed=0)
    yield engine
    engine.shutdown(drain_timeout_s=1.0)


async def uneven(ctx, sample):
    """The built-in generation, then a pause that grows with the sample's index (a slow tool call)."""
    await generate_one(ctx, sample)
    await asyncio.sleep(0.1 * sample.index)


def run(engine, each: bool):
    prompts = [Prompt(f"p{i}", "1", {}, i) for i in range(2)]
    feed = iter([(p, [5 + p.index, 9, 11]) for p in prompts])
    cfg = RolloutConfig(n_samples=3, prompts_per_step=2, max_new_tokens=6, placement="disaggregated")
    reward = RewardConfig(name="toy_rewards:slow_digits", score_each_sample=each)
    scheduler = RolloutScheduler(
        RolloutContext(LocalEngineClient(engine), engine.tokenizer, cfg, seed=3), lambda: next(feed, None),
        GroupBuffer(capacity=4), reward, n_samples=3, groups_per_step=2, max_staleness=0, max_in_flight=6,
        granularity="sample", generate=uneven,
    )  # fmt: skip

    async def go():
        scheduler.start()
        groups = []
        while len(groups) < 2:
            groups += scheduler.buffer.take(2 - len(groups), version=0)
            if len(groups) < 2:
                await asyncio.wait_for(scheduler.wait_change(), 60)
        metrics = scheduler.metrics()
        await scheduler.close()
        return sorted(groups, key=lambda g: g.group_id), metrics

    return asyncio.run(go())


def test_samples_scored_as_they_finish_get_the_groups_rewards_and_hide_behind_generation(engine):
    early, m_early = run(engine, each=True)
    late, m_late = run(engine, each=False)
    for a, b in zip(early, late):
        assert [s.response_ids for s in a.samples] == [s.response_ids for s in b.samples]  # seeded: the same answers
        assert [s.reward for s in a.samples] == [s.reward for s in b.samples] == [digits(s.response_text, "1", {}) for s in a.samples]
    assert m_early["reward/scored"] == m_late["reward/scored"] == 6
    assert m_early["time/reward_hidden_s"] > 0  # samples 0 and 1 were scored while sample 2 paused
    assert m_late["time/reward_hidden_s"] == 0


def test_an_evaluation_generates_at_most_max_groups_groups_at_once(engine):
    """``RolloutContext.max_groups`` (a shared evaluation's ``eval.batch_size``, which the engine's KV
    cache is sized for): at most that many groups generate together, each with all its samples, and
    every group still gets its answers; None lets all of them generate at once."""
    from noria.rollout.generate import rollout_groups

    cfg = RolloutConfig(n_samples=2, prompts_per_step=7, max_new_tokens=4)
    prompts = [(Prompt(f"p{i}", "1", {}, i), [5 + i, 9, 11]) for i in range(7)]
    for limit, expected in ((3, 3), (None, 7)):
        live, most = {}, 0

        async def counted(ctx, sample):
            nonlocal most
            live[sample.group_id] = live.get(sample.group_id, 0) + 1
            most = max(most, len(live))
            await generate_one(ctx, sample)
            await asyncio.sleep(0.05)  # hold the place a little: groups overlap as much as allowed
            live[sample.group_id] -= 1
            if not live[sample.group_id]:
                del live[sample.group_id]

        ctx = RolloutContext(LocalEngineClient(engine), engine.tokenizer, cfg, seed=3, max_groups=limit)
        result = asyncio.run(rollout_groups(ctx, prompts, 0, 2, RewardConfig(name="toy_rewards:digits"), counted))
        assert most == expected
        assert [len(g.samples) for g in result.groups] == [2] * 7 and all(s.response_ids for g in result.groups for s in g.samples)
