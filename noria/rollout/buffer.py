"""The group buffer between rollout and trainer: ``put(group)``, ``take(n)``, ``metrics()``.

What it owns: finished groups waiting to be trained on, in arrival order, and the count of groups
it dropped, by reason. A group is dropped where the information exists:

- on put, ``no_trainable_sample``: generation gave up on it (every sample aborted or failed);
- on take, ``stale``: the trainer's version minus the group's oldest policy-token version exceeds
  ``max_staleness`` (DESIGN.md section 1).

Synchronous RL (max staleness 0, the loop waits for the rollout before training) puts a step's
groups and takes them all back at once. Capacity bounds what may wait; ``put`` on a full buffer
raises here (the asynchronous scheduler that blocks on it comes with issue 6).

Checkpoints: ``state_dict`` holds the waiting groups and the counters, so a resumed run neither
trains a group twice nor loses one.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from typing import Any

from noria.errors import NoriaError
from noria.types import Group, Prompt, Sample, Status

TRAINABLE = (Status.COMPLETED, Status.TRUNCATED)


class BufferFull(NoriaError):
    """``put`` on a buffer that holds ``capacity`` groups."""


class GroupBuffer:
    """A bounded FIFO of groups with drop-on-put and staleness-on-take; see the module docstring."""

    def __init__(self, capacity: int, max_staleness: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.groups: deque[Group] = deque()
        self.dropped: Counter[str] = Counter()
        self.put_total = 0
        self.taken_total = 0
        self.last_staleness: list[int] = []

    def put(self, group: Group) -> bool:
        """Store ``group``; returns False when it was dropped (see ``dropped``)."""
        if not any(s.status in TRAINABLE and s.reward is not None for s in group.samples):
            self.dropped["no_trainable_sample"] += 1
            return False
        if len(self.groups) >= self.capacity:
            raise BufferFull(f"group buffer is full ({self.capacity} groups)")
        self.groups.append(group)
        self.put_total += 1
        return True

    def take(self, n: int, version: int) -> list[Group]:
        """Up to ``n`` groups, oldest first, dropping those too stale for trainer ``version``."""
        out: list[Group] = []
        self.last_staleness = []
        while self.groups and len(out) < n:
            group = self.groups.popleft()
            staleness = staleness_of(group, version)
            if staleness > self.max_staleness:
                self.dropped["stale"] += 1
                continue
            self.last_staleness.append(staleness)
            out.append(group)
        self.taken_total += len(out)
        return out

    def __len__(self) -> int:
        return len(self.groups)

    def metrics(self) -> dict[str, float]:
        s = self.last_staleness
        out = {
            "buffer/size": float(len(self.groups)),
            "buffer/staleness_mean": sum(s) / len(s) if s else 0.0,
            "buffer/staleness_max": float(max(s)) if s else 0.0,
        }
        out.update({f"buffer/dropped/{k}": float(v) for k, v in sorted(self.dropped.items())})
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "groups": [group_to_dict(g) for g in self.groups],
            "dropped": dict(self.dropped),
            "put_total": self.put_total,
            "taken_total": self.taken_total,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups = deque(group_from_dict(g) for g in state["groups"])
        self.dropped = Counter(state["dropped"])
        self.put_total = int(state["put_total"])
        self.taken_total = int(state["taken_total"])


def staleness_of(group: Group, version: int) -> int:
    """Trainer ``version`` minus the oldest weight version of any policy token in the group."""
    oldest = group.min_version
    return 0 if oldest is None else max(version - oldest, 0)


def group_to_dict(group: Group) -> dict[str, Any]:
    """Plain data (for checkpoints and inspection)."""
    prompt = dataclasses.asdict(group.prompt)
    prompt["prompt"] = group.prompt.prompt if isinstance(group.prompt.prompt, str) else [dict(m) for m in group.prompt.prompt]
    samples = []
    for s in group.samples:
        row = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
        row["status"] = s.status.value
        samples.append(row)
    return {"group_id": group.group_id, "prompt": prompt, "samples": samples}


def group_from_dict(data: dict[str, Any]) -> Group:
    prompt = dict(data["prompt"])
    if not isinstance(prompt["prompt"], str):
        prompt["prompt"] = tuple(dict(m) for m in prompt["prompt"])
    samples = []
    for row in data["samples"]:
        row = dict(row)
        row["status"] = Status(row["status"])
        samples.append(Sample(**row))
    return Group(group_id=int(data["group_id"]), prompt=Prompt(**prompt), samples=tuple(samples))
