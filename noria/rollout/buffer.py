"""The group buffer between rollout and trainer: the ``Buffer`` protocol and ``GroupBuffer``, the built-in one.

What it owns: finished groups waiting to be trained on (taken oldest policy version first, in
arrival order among equals), and the count of groups it dropped, by reason. A group is dropped
where the information exists:

- on put, ``no_trainable_sample``: generation gave up on it (every sample aborted or failed);
- on put, a filter's reason: ``zero_reward_variance`` (dynamic sampling: every reward equal, so
  every advantage is 0), ``over_length`` (a sample hit the token limit), or a user filter's;
- on take, ``stale``: the trainer's version minus the group's oldest policy-token version exceeds
  ``max_staleness``.

A dropped group goes to ``on_drop(group, reason)`` (the job returns its prompt to the data source or
discards it, by ``rollout.buffer.on_drop``). ``DropStreak`` is how the job notices that nothing can be
trained: past ``rollout.buffer.max_consecutive_drops`` drops in a row it raises, naming the reasons.

What blocks on what (one asyncio event loop; nothing here is thread-safe): ``await put`` waits
while the buffer holds ``capacity`` groups, until a ``take`` frees room; ``take`` never waits (it
returns what is there, at most ``n``; the caller waits for the producer). Capacity is a multiple of
the training batch (``rollout.buffer.capacity_batches``).

Replacing it: ``rollout.buffer.impl: pkg.module:Class``, a class meeting the :class:`Buffer`
protocol: built with the keyword arguments ``capacity``, ``max_staleness``, ``filters`` and
``on_drop``, with ``async put``, ``take``, ``metrics``, ``__len__``, ``state_dict`` and
``load_state_dict`` (checked at load by ``noria.plugins``; behaviour pinned by
tests/rollout/test_async_buffer.py and tests/test_plugin_contracts.py).

Checkpoints: ``state_dict`` holds the waiting groups and the counters, so a resumed run neither
trains a group twice nor loses one.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from noria.errors import NoriaError
from noria.plugins import load_plugin
from noria.types import Group, Prompt, Sample, Status

TRAINABLE = (Status.COMPLETED, Status.TRUNCATED)

GroupFilter = Callable[[Group], "str | None"]
"""``filter(group)`` -> None to keep the group, or the reason it is dropped."""
DropHook = Callable[[Group, str], None]


def zero_reward_variance(group: Group) -> str | None:
    """Dynamic sampling (DAPO): every scored reward equal, so every advantage would be 0."""
    rewards = {s.reward for s in group.samples if s.status in TRAINABLE and s.reward is not None}
    return "zero_reward_variance" if len(rewards) <= 1 else None


def over_length(group: Group) -> str | None:
    """A sample ran into the token limit: its reward judges a cut-off answer."""
    return "over_length" if any(s.status is Status.TRUNCATED for s in group.samples) else None


FILTERS: dict[str, GroupFilter] = {"zero_reward_variance": zero_reward_variance, "over_length": over_length}

DROP_REASONS: tuple[str, ...] = ("no_trainable_sample", *FILTERS, "stale")
"""Every reason the buffer itself drops a group for (``buffer/dropped/<reason>``); a user filter adds its own."""


def resolve_filters(names: Sequence[str]) -> list[GroupFilter]:
    """The filters named in ``rollout.buffer.filters`` (registered names or import paths)."""
    return [FILTERS[n] if n in FILTERS else load_plugin(n, "rollout.buffer.filters") for n in names]


class Buffer(Protocol):
    """Everything the loop's job and the rollout scheduler use of a buffer (``rollout.buffer.impl``).

    Built as ``cls(capacity=..., max_staleness=..., filters=[...], on_drop=hook)``: ``capacity`` in
    groups, ``max_staleness`` in weight versions, ``filters`` applied on put (each ``filter(group)``
    gives None or a drop reason), ``on_drop(group, reason)`` called for every group dropped. Calls
    come from one asyncio event loop; none needs to be thread-safe."""

    async def put(self, group: Group) -> bool:
        """Store a finished group; may wait while the buffer is full (the scheduler awaits it).
        False when the group was dropped instead (``on_drop`` was called)."""
        ...

    def take(self, n: int, version: int) -> list[Group]:
        """At most ``n`` groups to train at trainer ``version``, never waiting; a group staler than
        ``max_staleness`` is dropped, never returned. Every group is returned at most once."""
        ...

    def metrics(self, version: int) -> dict[str, float]:
        """Figures for the step's metrics line (``buffer/...``), at trainer ``version``."""
        ...

    def __len__(self) -> int:
        """Groups waiting (the scheduler's admission counts them)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able) holding every waiting group, for checkpoints."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (on a buffer built with the same arguments)."""
        ...


class GroupBuffer:
    """A bounded FIFO of groups with drops on put and staleness on take; the built-in :class:`Buffer`."""

    def __init__(
        self,
        capacity: int,
        max_staleness: int = 0,
        filters: Sequence[GroupFilter] = (),
        on_drop: DropHook | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.filters = list(filters)
        self.on_drop = on_drop
        self.groups: deque[Group] = deque()
        self.dropped: Counter[str] = Counter()
        self.put_total = 0
        self.taken_total = 0
        self.last_staleness: list[int] = []
        self._generated = self._kept = 0  # groups offered and kept since the last metrics call
        self._lengths = LengthBias()  # length and reward by staleness since the last metrics call
        self._room = asyncio.Event()

    async def put(self, group: Group) -> bool:
        """Store ``group`` (waiting while the buffer is full); False when it was dropped instead."""
        reason = self.drop_reason(group)
        self._generated += 1
        if reason is not None:
            self.drop(group, reason)
            return False
        self._kept += 1
        while len(self.groups) >= self.capacity:
            self._room.clear()
            await self._room.wait()
        self.groups.append(group)
        self.put_total += 1
        return True

    def drop_reason(self, group: Group) -> str | None:
        if not any(s.status in TRAINABLE and s.reward is not None for s in group.samples):
            return DROP_REASONS[0]
        for keep_or_reason in (f(group) for f in self.filters):
            if keep_or_reason is not None:
                return str(keep_or_reason)
        return None

    def take(self, n: int, version: int) -> list[Group]:
        """Up to ``n`` groups, the oldest policy version first (arrival order among equals), dropping those
        too stale for trainer ``version``. Oldest version first: a group that took long to finish (long
        answers, a slow tool) is trained while it is still within ``max_staleness`` instead of waiting
        behind newer groups until it is dropped; synchronous runs (one version) keep arrival order."""
        out: list[Group] = []
        chosen: set[int] = set()
        for group in sorted(self.groups, key=lambda g: _version_key(g, version)):  # stable: arrival order among equals
            if len(out) == n:
                break
            chosen.add(id(group))
            staleness = staleness_of(group, version)
            if staleness > self.max_staleness:
                self.drop(group, "stale")
                continue
            self.last_staleness.append(staleness)
            self._lengths.taken(group, staleness)
            out.append(group)
        if chosen:
            self.groups = deque(g for g in self.groups if id(g) not in chosen)
        self.taken_total += len(out)
        self._room.set()
        return out

    def drop(self, group: Group, reason: str) -> None:
        self.dropped[reason] += 1
        if reason == "stale":
            self._lengths.dropped(group)
        if self.on_drop is not None:
            self.on_drop(group, reason)

    def __len__(self) -> int:
        return len(self.groups)

    def metrics(self, version: int) -> dict[str, float]:
        """Size and capacity; staleness of the groups taken since the last call and of those waiting."""
        taken, self.last_staleness = self.last_staleness, []
        waiting = [staleness_of(g, version) for g in self.groups]
        out = {
            "buffer/size": float(len(self.groups)),
            "buffer/capacity": float(self.capacity),
            "buffer/staleness_mean": sum(taken) / len(taken) if taken else 0.0,
            "buffer/staleness_max": float(max(taken)) if taken else 0.0,
            "buffer/waiting_staleness_mean": sum(waiting) / len(waiting) if waiting else 0.0,
            "buffer/waiting_staleness_max": float(max(waiting)) if waiting else 0.0,
        }
        out.update({f"buffer/dropped/{k}": float(v) for k, v in sorted(self.dropped.items())})
        if self.max_staleness > 0:  # asynchronous: is a long answer likelier to be trained stale, or dropped?
            out.update(self._lengths.collect())
        if self._kept:  # dynamic sampling's cost: groups generated for each one kept, since the last line
            out["buffer/generated_per_kept"] = self._generated / self._kept
            self._generated = self._kept = 0
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


class LengthBias:
    """Response length and reward of the groups taken, by staleness, and the length of those dropped as
    stale: under a staleness bound, long answers finish late and are trained staler or dropped more
    often, which biases what the policy learns from (``buffer/by_staleness/...``)."""

    def __init__(self) -> None:
        self.by_staleness: dict[int, list[float]] = {}  # staleness -> [samples, tokens, reward sum, rewards]
        self.stale_dropped: list[float] = [0.0, 0.0]  # samples, tokens

    def taken(self, group: Group, staleness: int) -> None:
        row = self.by_staleness.setdefault(staleness, [0.0, 0.0, 0.0, 0.0])
        for s in group.samples:
            row[0] += 1
            row[1] += len(s.response_ids)
            if s.reward is not None:
                row[2] += s.reward
                row[3] += 1

    def dropped(self, group: Group) -> None:
        self.stale_dropped[0] += len(group.samples)
        self.stale_dropped[1] += sum(len(s.response_ids) for s in group.samples)

    def collect(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for k, (n, tokens, reward, scored) in sorted(self.by_staleness.items()):
            out[f"buffer/by_staleness/{k}/response_len_mean"] = tokens / n if n else 0.0
            if scored:
                out[f"buffer/by_staleness/{k}/reward_mean"] = reward / scored
        if self.stale_dropped[0]:
            out["buffer/stale_dropped_len_mean"] = self.stale_dropped[1] / self.stale_dropped[0]
        self.__init__()
        return out


class DropStreak:
    """Groups dropped since the trainer last took one, by reason, with the first failure seen; past
    ``limit`` in a row, ``NoriaError`` naming them (a run that can train nothing stops, loudly)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.reasons: Counter[str] = Counter()
        self.example = ""

    def dropped(self, group: Group, reason: str) -> None:
        self.reasons[reason] += 1
        self.example = self.example or failure_example(group)
        if sum(self.reasons.values()) >= self.limit:
            raise NoriaError(f"no group could be trained: {self.describe()} (rollout.buffer.max_consecutive_drops={self.limit})")

    def trained(self) -> None:
        self.reasons.clear()
        self.example = ""

    def describe(self) -> str:
        """``N groups dropped in a row (reason: n, ...); e.g. group G: <why>``."""
        n = sum(self.reasons.values())
        text = f"{n} groups dropped in a row ({', '.join(f'{r}: {k}' for r, k in self.reasons.most_common())})"
        return text + (f"; e.g. {self.example}" if self.example else "")


def failure_example(group: Group) -> str:
    """Why the first failed or aborted sample of ``group`` failed ("" when none did)."""
    bad = next((s for s in group.samples if s.status not in TRAINABLE and s.status_reason), None)
    return f"group {group.group_id}: {bad.status.value}: {bad.status_reason}" if bad else ""


def build_buffer(impl: str, **kwargs: Any) -> Buffer:
    """The built-in ``GroupBuffer``, or the class at import path ``impl`` (``rollout.buffer.impl``)."""
    cls = load_plugin(impl, "rollout.buffer.impl") if impl else GroupBuffer
    return cls(**kwargs)


def _version_key(group: Group, version: int) -> int:
    oldest = group.min_version
    return version if oldest is None else oldest


def staleness_of(group: Group, version: int) -> int:
    """Trainer ``version`` minus the oldest weight version of any policy token in the group."""
    oldest = group.min_version
    return 0 if oldest is None else max(version - oldest, 0)


def prompt_to_dict(prompt: Prompt) -> dict[str, Any]:
    """Plain data, in the data source's checkpoint format."""
    data = dataclasses.asdict(prompt)
    data["prompt"] = prompt.prompt if isinstance(prompt.prompt, str) else [dict(m) for m in prompt.prompt]
    return data


def group_to_dict(group: Group) -> dict[str, Any]:
    """Plain data (for checkpoints and inspection)."""
    prompt = prompt_to_dict(group.prompt)
    samples = []
    for s in group.samples:
        row = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
        row["status"] = s.status.value
        if s.routed_experts is not None:
            row["routed_experts"] = routes_to_dict(s.routed_experts)
        if s.latents is not None:  # image trajectories (noria.diffusion): raw bytes too, exact
            row["latents"] = routes_to_dict(s.latents)
        if s.image is not None:
            import torch

            row["image"] = routes_to_dict(torch.from_numpy(s.image))
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
        if row.get("routed_experts") is not None:
            row["routed_experts"] = routes_from_dict(row["routed_experts"])
        if row.get("latents") is not None:
            row["latents"] = routes_from_dict(row["latents"])
        if row.get("image") is not None:
            row["image"] = routes_from_dict(row["image"]).numpy()
        samples.append(Sample(**row))
    return Group(group_id=int(data["group_id"]), prompt=Prompt(**prompt), samples=tuple(samples))


def routes_to_dict(routes: torch.Tensor) -> dict[str, Any]:
    """MoE routes as plain JSON data (checkpoints keep the buffer in JSON): dtype, shape and the
    raw bytes in base64, so they cost their compact size (int8: one byte per id), not a list."""
    t = routes.detach().to("cpu").contiguous()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": base64.b64encode(t.numpy().tobytes()).decode("ascii")}


def routes_from_dict(data: dict[str, Any]) -> torch.Tensor:
    import torch

    dtype = getattr(torch, data["dtype"])
    raw = bytearray(base64.b64decode(data["data"]))
    return torch.frombuffer(raw, dtype=dtype).view(*data["shape"]) if raw else torch.empty(data["shape"], dtype=dtype)
