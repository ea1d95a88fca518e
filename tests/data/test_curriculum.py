"""Difficulty pools (``noria.data.curriculum``): prompts pooled after a window of all-easy or all-hard
groups, skipped by the cursor, revisited at their rate, released by a mixed revisit; the state
round-trips through JSON and a restored curriculum hands out what the original would; the real
scheduler tells it each scored group's rewards; config checks name the key."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch

from noria.config import DataConfig, EngineConfig, RewardConfig, RolloutConfig
from noria.config.schema import ConfigError
from noria.data import PromptSource
from noria.data.curriculum import Curriculum
from noria.types import Prompt


def prompts(n: int = 8) -> list[Prompt]:
    return [Prompt(f"p{i}", str(i), {}, i, "test") for i in range(n)]


def curriculum(n: int = 8, *, easy_rate: float = 0.0, hard_rate: float = 0.0, epochs: int = 4, window: int = 2) -> Curriculum:
    ps = prompts(n)
    source = PromptSource(ps, shuffle=False, seed=3, epochs=epochs)
    return Curriculum(source, ps, window=window, easy_reward=1.0, hard_reward=0.0, easy_rate=easy_rate,
                      hard_rate=hard_rate, seed=3)  # fmt: skip


def indices(batch: list[Prompt]) -> list[int]:
    return [p.index for p in batch]


def test_prompts_are_pooled_after_a_window_of_equal_outcomes_and_skipped_by_the_cursor():
    c = curriculum()
    p = prompts()
    assert indices(c.next_batch(8)) == list(range(8))
    c.observe(p[1], [1.0, 1.0, 1.0])  # easy once: not yet
    c.observe(p[2], [0.0, 0.0])  # hard once
    c.observe(p[3], [0.0, 1.0])  # mixed
    assert c.pool_of(1) is None and c.pool_of(2) is None
    c.observe(p[1], [1.0, 1.0])
    c.observe(p[2], [0.0, -0.5])
    c.observe(p[3], [1.0, 1.0])  # mixed then easy: no window of equal outcomes
    assert (c.pool_of(1), c.pool_of(2), c.pool_of(3)) == ("easy", "hard", None)
    assert indices(c.next_batch(8)) == [0, 3, 4, 5, 6, 7, 0, 3]  # rates 0: pooled prompts never come out
    m = c.metrics()
    assert m["curriculum/easy_pool"] == 1 and m["curriculum/hard_pool"] == 1
    assert m["curriculum/pooled"] == 2 and m["curriculum/skipped"] == 4 and m["curriculum/revisits"] == 0
    assert c.metrics()["curriculum/skipped"] == 0  # interval figures start over


def test_a_pool_is_revisited_at_its_rate_and_a_mixed_revisit_releases_the_prompt():
    c = curriculum(easy_rate=0.5, epochs=100)
    p = prompts()
    for _ in range(2):
        c.observe(p[4], [1.0, 1.0])
    drawn = []
    for _ in range(400):
        drawn += indices(c.next_batch(1))
        if drawn[-1] == 4:
            c.observe(p[4], [1.0, 1.0])  # still easy: back in its pool
    share = drawn.count(4) / len(drawn)
    assert 0.4 < share < 0.6, share  # seeded draws at easy_rate 0.5; the cursor skips it meanwhile
    c2 = curriculum(easy_rate=1.0)
    for _ in range(2):
        c2.observe(p[4], [1.0, 1.0])
    assert indices(c2.next_batch(1)) == [4]  # out on a revisit: the pool is empty meanwhile
    assert indices(c2.next_batch(2)) == [0, 1]
    c2.observe(p[4], [1.0, 0.0])  # the revisit scored mixed: back in rotation
    assert c2.pool_of(4) is None and c2.metrics()["curriculum/released"] == 1
    assert indices(c2.next_batch(3)) == [2, 3, 4]


def test_state_round_trips_through_json_and_a_restored_curriculum_continues_identically():
    a = curriculum(easy_rate=0.3, hard_rate=0.3, epochs=50)
    p = prompts()
    for i in (1, 2, 5):
        for _ in range(2):
            a.observe(p[i], [1.0, 1.0] if i != 2 else [0.0, 0.0])
    a.next_batch(5)
    a.return_prompt(p[6])
    state = json.loads(json.dumps(a.state_dict()))
    b = curriculum(easy_rate=0.3, hard_rate=0.3, epochs=50)
    b.load_state_dict(state)
    assert indices(a.next_batch(60)) == indices(b.next_batch(60))
    assert (b.pool_of(1), b.pool_of(2)) == ("easy", "hard")


def test_a_checkpoint_without_pools_restores_its_cursor():
    plain = PromptSource(prompts(), shuffle=False, seed=3, epochs=4)
    plain.next_batch(3)
    c = curriculum()
    c.load_state_dict(json.loads(json.dumps(plain.state_dict())))
    assert indices(c.next_batch(2)) == [3, 4]


def test_a_returned_prompt_waiting_in_its_pool_is_not_handed_out_twice():
    c = curriculum()
    p = prompts()
    for _ in range(2):
        c.observe(p[0], [0.0, 0.0])
    c.return_prompt(p[0])
    c.return_prompt(p[1])
    assert indices(c.next_batch(2)) == [1, 1]  # 0 skipped twice (it waits in the hard pool): returned 1, then the cursor's 1
    assert c.metrics()["curriculum/skipped"] == 2


@pytest.mark.parametrize(
    "kw, key",
    [({"window": 0}, "window"), ({"easy_reward": 0.0}, "hard_reward"), ({"easy_rate": 1.5}, "easy_rate"),
     ({"easy_rate": 0.6, "hard_rate": 0.6}, "easy_rate + hard_rate")],
)
def test_config_checks_name_the_key(kw, key):
    cfg = DataConfig(task="arithmetic")
    cfg.curriculum.enabled = True
    for k, v in kw.items():
        setattr(cfg.curriculum, k, v)
    with pytest.raises(ConfigError, match=re.escape(f"data.curriculum.{key}")):
        cfg.validate()


def test_the_scheduler_tells_the_curriculum_each_scored_group(tiny_model_dir):
    from noria.engine import Engine
    from noria.models import load_model, load_tokenizer
    from noria.rollout import LocalEngineClient, RolloutContext
    from noria.rollout.buffer import GroupBuffer
    from noria.rollout.scheduler import RolloutScheduler

    engine = Engine(load_model(tiny_model_dir, dtype=torch.float32), load_tokenizer(tiny_model_dir),
                    EngineConfig(kv_cache_tokens=2048), seed=0)  # fmt: skip
    seen: list[tuple[int, list[float]]] = []
    ps = prompts(3)
    feed = iter([(p, [5 + p.index, 9, 11]) for p in ps])
    cfg = RolloutConfig(n_samples=3, prompts_per_step=3, max_new_tokens=4, placement="disaggregated")
    ctx = RolloutContext(LocalEngineClient(engine), engine.tokenizer, cfg, seed=1)
    scheduler = RolloutScheduler(
        ctx, lambda: next(feed, None), GroupBuffer(capacity=8), RewardConfig(name="toy_rewards:digits"), n_samples=3,
        groups_per_step=3, max_staleness=0, max_in_flight=9, granularity="group",
        observe=lambda prompt, rewards: seen.append((prompt.index, rewards)),
    )  # fmt: skip

    async def run() -> list:
        scheduler.start()
        groups: list = []
        while len(groups) < 3:
            groups += scheduler.buffer.take(3 - len(groups), version=0)
            if len(groups) < 3:
                await asyncio.wait_for(scheduler.wait_change(), 60)
        await scheduler.close()
        return groups

    try:
        groups = asyncio.run(run())
    finally:
        engine.shutdown(drain_timeout_s=1.0)
    assert sorted(i for i, _ in seen) == [0, 1, 2]
    by_prompt = {g.prompt.index: [s.reward for s in g.samples] for g in groups}
    assert all(by_prompt[i] == rewards and len(rewards) == 3 for i, rewards in seen)
