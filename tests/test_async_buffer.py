"""The group buffer (CPU, no model): blocking put, drops by reason, pessimistic staleness, checkpoint
state, and the contract any replacement buffer (``rollout.buffer.impl``) must keep."""

from __future__ import annotations

import asyncio
from collections import Counter, deque

import pytest

from noria.rollout.buffer import GroupBuffer, build_buffer, resolve_filters, staleness_of
from noria.types import Group, Prompt, Sample, Status


def group(gid: int, rewards=(0.0, 1.0), versions=(0,), status=Status.COMPLETED) -> Group:
    samples = tuple(
        Sample(prompt_ids=[1], response_ids=[5] * len(versions), loss_mask=[1] * len(versions), rollout_logprobs=[0.0] * len(versions),
               weight_versions=list(versions), reward=r, status=status, group_id=gid, index=i)
        for i, r in enumerate(rewards)
    )  # fmt: skip
    return Group(group_id=gid, prompt=Prompt(f"p{gid}", index=gid), samples=samples)


class ListBuffer:
    """A replacement buffer loaded by import path: unbounded, newest first (LIFO), no filters."""

    def __init__(self, capacity, max_staleness=0, filters=(), on_drop=None):
        self.items: deque[Group] = deque()
        self.max_staleness, self.on_drop, self.dropped = max_staleness, on_drop, Counter()

    async def put(self, group):
        self.items.append(group)
        return True

    def take(self, n, version):
        out = []
        while self.items and len(out) < n:
            g = self.items.pop()
            if staleness_of(g, version) > self.max_staleness:
                self.dropped["stale"] += 1
                self.on_drop and self.on_drop(g, "stale")
                continue
            out.append(g)
        return out

    def metrics(self, version):
        return {"buffer/size": float(len(self.items))}

    def __len__(self):
        return len(self.items)

    def state_dict(self):
        from noria.rollout.buffer import group_to_dict

        return {"groups": [group_to_dict(g) for g in self.items]}

    def load_state_dict(self, state):
        from noria.rollout.buffer import group_from_dict

        self.items = deque(group_from_dict(g) for g in state["groups"])


@pytest.mark.parametrize("impl", ["", "test_async_buffer:ListBuffer"])
def test_contract_of_any_buffer(impl):
    """What the job relies on: put/take/len/metrics, staleness bound on take, no group twice, state round trip."""

    async def main():
        dropped = []
        buf = build_buffer(impl, capacity=8, max_staleness=1, filters=[], on_drop=lambda g, r: dropped.append((g.group_id, r)))
        for gid, v in [(0, 0), (1, 2), (2, 3), (3, 3)]:
            assert await buf.put(group(gid, versions=(v,))) is True
        assert len(buf) == 4
        clone = build_buffer(impl, capacity=8, max_staleness=1)
        clone.load_state_dict(buf.state_dict())
        taken = buf.take(10, version=3)
        assert sorted(g.group_id for g in taken) == [1, 2, 3]  # group 0 is 3 versions old
        assert dropped == [(0, "stale")] and len(buf) == 0 and buf.take(1, 3) == []
        assert "buffer/size" in buf.metrics(3)
        assert sorted(g.group_id for g in clone.take(10, version=1)) == [0, 1, 2, 3]

    asyncio.run(main())


def test_put_blocks_while_full_until_a_take():
    async def main():
        buf = GroupBuffer(capacity=2)
        await buf.put(group(0))
        await buf.put(group(1))
        blocked = asyncio.create_task(buf.put(group(2)))
        await asyncio.sleep(0.05)
        assert not blocked.done() and len(buf) == 2
        assert [g.group_id for g in buf.take(1, 0)] == [0]
        assert await asyncio.wait_for(blocked, 1) is True
        assert [g.group_id for g in buf.take(5, 0)] == [1, 2]

    asyncio.run(main())


def test_drops_on_put_by_reason_and_returned_to_the_hook():
    async def main():
        seen = []
        buf = GroupBuffer(4, filters=resolve_filters(["zero_reward_variance", "over_length"]), on_drop=lambda g, r: seen.append(r))
        assert not await buf.put(group(0, status=Status.ABORTED, rewards=(None, None)))
        assert not await buf.put(group(1, rewards=(1.0, 1.0)))
        assert not await buf.put(group(2, status=Status.TRUNCATED))
        assert await buf.put(group(3))
        assert seen == ["no_trainable_sample", "zero_reward_variance", "over_length"]
        m = buf.metrics(0)
        assert m["buffer/dropped/zero_reward_variance"] == 1 and m["buffer/size"] == 1 and m["buffer/capacity"] == 4

    asyncio.run(main())


def test_staleness_is_pessimistic_over_mixed_versions():
    g = group(0, versions=(2, 2, 3, 4))  # a trajectory that spanned two weight updates
    assert g.min_version == 2 and staleness_of(g, 5) == 3

    async def main():
        buf = GroupBuffer(4, max_staleness=2)
        await buf.put(g)
        await buf.put(group(1, versions=(4, 5)))
        assert buf.metrics(5)["buffer/waiting_staleness_max"] == 3
        assert [x.group_id for x in buf.take(2, 5)] == [1]
        m = buf.metrics(5)
        assert m["buffer/dropped/stale"] == 1 and m["buffer/staleness_max"] == 1

    asyncio.run(main())


def test_user_filter_by_import_path_and_bad_path_names_the_key():
    assert resolve_filters(["test_async_buffer:drop_odd"])[0](group(3)) == "odd"
    with pytest.raises(Exception, match="rollout.buffer.filters"):
        resolve_filters(["test_async_buffer:nope"])


def drop_odd(g: Group) -> str | None:
    return "odd" if g.group_id % 2 else None
