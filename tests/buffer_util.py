"""Helpers of the buffer tests (tests/rollout/test_async_buffer.py, tests/test_plugin_contracts.py,
tests/test_metrics.py): a group of samples, and the contract any buffer (``rollout.buffer.impl``) must keep."""

from __future__ import annotations

import asyncio

from noria.rollout.buffer import build_buffer
from noria.types import Group, Prompt, Sample, Status


def group(gid: int, rewards=(0.0, 1.0), versions=(0,), status=Status.COMPLETED) -> Group:
    samples = tuple(
        Sample(prompt_ids=[1], response_ids=[5] * len(versions), loss_mask=[1] * len(versions), rollout_logprobs=[0.0] * len(versions),
               weight_versions=list(versions), reward=r, status=status, group_id=gid, index=i)
        for i, r in enumerate(rewards)
    )  # fmt: skip
    return Group(group_id=gid, prompt=Prompt(f"p{gid}", index=gid), samples=samples)


def check_buffer_contract(impl: str) -> None:
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
