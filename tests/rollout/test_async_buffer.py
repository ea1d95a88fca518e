"""The group buffer (CPU, no model): blocking put, drops by reason, pessimistic staleness, checkpoint
state, and the contract any replacement buffer (``rollout.buffer.impl``) must keep."""

from __future__ import annotations

import asyncio

import pytest

from buffer_util import check_buffer_contract, group
from noria.rollout.buffer import GroupBuffer, resolve_filters, staleness_of
from noria.types import Status


@pytest.mark.parametrize("impl", ["", "buffer_plugins:ListBuffer"])
def test_contract_of_any_buffer(impl):
    check_buffer_contract(impl)


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
    assert resolve_filters(["buffer_plugins:drop_odd"])[0](group(3)) == "odd"
    with pytest.raises(Exception, match="rollout.buffer.filters"):
        resolve_filters(["buffer_plugins:nope"])
