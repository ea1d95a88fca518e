"""Buffers and a filter for tests, loaded through the real plug points ``rollout.buffer.impl`` and
``rollout.buffer.filters``."""

from __future__ import annotations

from collections import Counter, deque

from noria.rollout.buffer import GroupBuffer, staleness_of
from noria.types import Group


class ReserveBuffer(GroupBuffer):
    """The built-in buffer, except that ``take`` always leaves its newest group waiting: every
    checkpoint of an asynchronous run then holds at least one buffered group, by construction
    (tests/launch/test_chaos_run.py kills a run right after such a checkpoint)."""

    def take(self, n: int, version: int) -> list[Group]:
        out: list[Group] = []
        while len(self) > 1 and len(out) < n:
            out += super().take(1, version)
        return out


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


def drop_odd(g: Group) -> str | None:
    return "odd" if g.group_id % 2 else None
