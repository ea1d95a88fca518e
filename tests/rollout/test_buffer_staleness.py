"""The group buffer under staleness (``noria.rollout.buffer``): the oldest policy version is taken
first, so a group that finished late is trained rather than dropped; an asynchronous buffer reports
length and reward by staleness and the length of groups dropped as stale (length bias), a
synchronous one does not."""

from __future__ import annotations

import asyncio

from noria.rollout.buffer import GroupBuffer
from noria.types import Group, Prompt, Sample, Status


def sample(tokens: int, reward: float | None = 1.0, version: int = 0) -> Sample:
    return Sample(prompt_ids=[1], response_ids=[7] * tokens, loss_mask=[1] * tokens, rollout_logprobs=[0.0] * tokens,
                  weight_versions=[version] * tokens, reward=reward, status=Status.COMPLETED)  # fmt: skip


def group(gid: int, lengths: list[int], rewards: list[float], version: int = 0) -> Group:
    return Group(group_id=gid, prompt=Prompt("p", "1", {}, gid), samples=tuple(sample(n, r, version) for n, r in zip(lengths, rewards)))


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


def test_the_oldest_policy_version_is_taken_first_so_a_late_group_is_trained_not_dropped():
    async def run() -> tuple[list[int], dict[str, float]]:
        buffer = GroupBuffer(capacity=8, max_staleness=1)
        for gid, version in ((0, 2), (1, 1), (2, 2), (3, 1)):  # 1 and 3 (version 1) finished after newer groups
            await buffer.put(group(gid, [4, 4], [1.0, 0.0], version=version))
        first = [g.group_id for g in buffer.take(2, version=2)]
        rest = [g.group_id for g in buffer.take(2, version=3)]  # at version 3, version 1 would be stale
        return first + rest, buffer.metrics(3)

    order, m = asyncio.run(run())
    assert order == [1, 3, 0, 2] and "buffer/dropped/stale" not in m  # FIFO would have dropped 1 and 3
