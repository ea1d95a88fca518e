"""Buffers for tests, loaded through the real plug point ``rollout.buffer.impl``."""

from __future__ import annotations

from noria.rollout.buffer import GroupBuffer
from noria.types import Group


class ReserveBuffer(GroupBuffer):
    """The built-in buffer, except that ``take`` always leaves its newest group waiting: every
    checkpoint of an asynchronous run then holds at least one buffered group, by construction
    (tests/test_chaos_run.py kills a run right after such a checkpoint)."""

    def take(self, n: int, version: int) -> list[Group]:
        out: list[Group] = []
        while len(self) > 1 and len(out) < n:
            out += super().take(1, version)
        return out
