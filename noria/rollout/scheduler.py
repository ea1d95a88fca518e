"""The rollout scheduler: a background worker that keeps the engines busy and fills the group buffer.

How data moves::

    next_prompt() ─▶ admit? ─▶ n_samples x generate fn ─▶ Group ─▶ reward ─▶ await buffer.put(group)
                       ▲           (each holds a place)                       (waits while full)
                       └── wakes on: a place freed, a put done, a take, a new weight version

At most ``max_in_flight`` trajectories generate at once. Places free by ``granularity``:

- ``group``: a group's places free only when all its trajectories have finished;
- ``sample`` (the default of asynchronous RL): each finished trajectory frees its place, so one
  long trajectory does not hold its group's other places; a new group starts once ``n_samples``
  places are free.

A group is produced per trajectory with a generate function (``generate``), or whole through
``rollout_group`` (a rollout or agent function, ``noria.rollout.generate.run_rollout``); the latter
frees its places when the group is done, whatever the granularity.

Admission (staleness, AReaL's rule): a group started now is trained after every group already
trained, waiting or in flight, so it is admitted only while
``trained + waiting + in flight < (version + max_staleness + 1) * groups_per_step``, ``version``
being the weights the engines serve, read from its owner (the job's ``weight_version``) through the
``version`` callable; ``on_new_version`` only wakes the worker. With ``max_staleness`` 0 that is exactly synchronous RL: one
step's groups, then nothing until the trainer has taken them and pushed new weights. The bound is
on admission; the buffer still checks every group's real staleness on take (groups finish out of
order), and a stale group is dropped there.

What blocks on what: the worker waits for a wake-up; the trainer waits in ``wait_change`` until a
group lands or the worker stops. Everything runs on one asyncio event loop (the trainer's compute
runs in a thread and never touches this object).

Engine loss (a fleet, ``noria.launch.fleet``): a trajectory whose engine died raises ``EngineLost``;
the whole group is then regenerated under the same group id and prompt, from scratch, once the
fleet has an engine serving again (``EngineLost.ready``): no group is lost, and none reaches the
buffer twice (a group is put only when all of it was generated). ``rollout/groups_regenerated``
counts them. Any other ``EngineFailure`` stops the worker as below.

Shutdown (``close``): no new group starts, in-flight trajectories are cancelled and awaited, and
the prompts of unfinished groups are reported (``unfinished_prompts``) so that a checkpoint keeps
them. A failure in any trajectory (``EngineFailure``) stops the worker and is raised to the trainer
from ``wait_change``.

Checkpoints (``rollout.resume_in_flight`` continue; ``noria.rollout.in_flight``): ``record_in_flight``
stops every trajectory where it is, with its tokens, and returns the groups started and not yet in
the buffer as plain data; nothing moves until ``release_in_flight``, after which each continues from
its tokens. A resumed run restarts the recorded groups under their ids (``resume_groups``) before
any new one. Each group's state for this is kept as it moves: samples while generating
(``_samples``), being scored (``_scoring``, which a record waits out: scoring writes into samples),
scored and waiting for buffer room (``_putting``).

Not guaranteed: the order groups finish in; with several trajectories of a group retracted for a
weight update, which of them resumes first.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from noria import faults
from noria.config import RewardConfig
from noria.data.vision_chat import prompt_images
from noria.rewards.runner import ScoreCounts, score_groups_async, scores_in_batches
from noria.rewards.shaping import shape_overlong
from noria.rollout.buffer import TRAINABLE, Buffer, group_to_dict
from noria.rollout.client import EngineFailure
from noria.rollout.generate import GenerateFn, RolloutContext, RolloutResult, generate_one
from noria.types import Group, Prompt, Sample, Status

PromptFeed = Callable[[], "tuple[Prompt, list[int]] | None"]
"""The next (prompt, prompt ids) to roll out, or None when the data source has none now."""
GroupRollout = Callable[..., Awaitable[RolloutResult]]
"""``(ctx, [(prompt, ids)], group_id, n_samples, reward) -> RolloutResult`` of that one group."""


class EngineLost(EngineFailure):
    """The engine that served a trajectory died and the fleet is replacing it: the group is
    regenerated once ``await ready()`` returns (an engine serves the current weights again)."""

    def __init__(self, message: str, ready: Callable[[], Awaitable[None]]) -> None:
        super().__init__(message)
        self.ready = ready


class RolloutScheduler:
    """Keeps up to ``max_in_flight`` trajectories generating and puts finished groups in ``buffer``."""

    def __init__(
        self,
        ctx: RolloutContext,
        next_prompt: PromptFeed,
        buffer: Buffer,
        reward: RewardConfig,
        *,
        n_samples: int,
        groups_per_step: int,
        max_staleness: int,
        max_in_flight: int,
        granularity: str,
        next_group_id: int = 0,
        version: Callable[[], int] = lambda: 0,
        trained: int = 0,
        generate: GenerateFn = generate_one,
        rollout_group: GroupRollout | None = None,
        observe: Callable[[Prompt, list[float]], None] | None = None,
    ) -> None:
        if granularity not in ("group", "sample"):
            raise ValueError(f"granularity must be group or sample, got {granularity!r}")
        self.ctx, self.next_prompt, self.buffer, self.reward = ctx, next_prompt, buffer, reward
        self.generate, self.rollout_group = generate, rollout_group
        self.n_samples, self.groups_per_step, self.max_staleness = n_samples, groups_per_step, max_staleness
        self.max_in_flight, self.granularity = max_in_flight, granularity
        self.next_group_id, self.trained = next_group_id, trained
        self._score_early = reward.score_each_sample and not scores_in_batches(reward)
        """Score each sample as it finishes; a batched (TRL-style) reward gets whole groups instead."""
        self.observe = observe
        """Told each scored group's prompt and its trainable samples' rewards (``noria.data.curriculum``)."""
        self.version = version
        """The weight version the engines serve, read from its owner (``noria.loop.Job.weight_version``)."""
        self.in_flight = 0  # trajectories holding a place
        self.pending: dict[int, Prompt] = {}  # groups started and not yet put, by id
        self.error: BaseException | None = None
        self.finished = False  # no prompt left and nothing pending: the worker has stopped
        self._tasks: set[asyncio.Task] = set()
        self._worker: asyncio.Task | None = None
        self._stopping = False
        self._held = False
        self._wake_worker, self._wake_trainer = asyncio.Event(), asyncio.Event()
        # In-flight record (noria.rollout.in_flight): each group's state while a checkpoint may look.
        self._samples: dict[int, tuple[Sample, ...]] = {}  # group id -> its samples, while generating
        self._putting: dict[int, Group] = {}  # scored groups not yet in the buffer (it may be full)
        self._unfinished = 0  # trajectories whose generate call has not returned
        self._scoring = 0  # groups being scored
        self._recording = False  # a checkpoint records: no group starts
        self._wake_recorder = asyncio.Event()
        if ctx.live is not None:
            ctx.live.changed = self._notify
        self._stats = _Interval()

    # ------------------------------------------------------------------------------ control

    def start(self) -> None:
        self._worker = asyncio.create_task(self._run(), name="rollout-scheduler")

    async def close(self) -> None:
        """Stop starting groups, cancel the in-flight ones and wait for them (prompts stay in ``pending``)."""
        self._stopping = True
        for task in [*self._tasks, *([self._worker] if self._worker else [])]:
            task.cancel()
        await asyncio.gather(*self._tasks, *([self._worker] if self._worker else []), return_exceptions=True)

    def on_taken(self, n: int) -> None:
        """The trainer took ``n`` groups from the buffer (room freed, admission moves)."""
        self.trained += n
        if n:
            self._notify()

    def hold(self, held: bool) -> None:
        """While held, no group starts (a colocated engine is paused for the trainer's turn)."""
        self._held = held
        self._notify()

    def on_new_version(self) -> None:
        """The engines serve a new weight version now (admission moves)."""
        self._notify()

    async def wait_change(self) -> None:
        """Until a group lands in the buffer, is dropped, or the worker stops; raises the worker's error."""
        self._raise_error()
        if not self.finished:  # the caller looked at the buffer just now, without awaiting since
            self._wake_trainer.clear()
            await self._wake_trainer.wait()
        self._raise_error()

    @contextlib.asynccontextmanager
    async def in_flight_stopped(self) -> AsyncIterator[list[dict[str, Any]] | None]:
        """For a checkpoint: the groups in flight stopped and recorded for the body (``record_in_flight``),
        then released; None without ``ctx.live`` (``rollout.resume_in_flight`` retract)."""
        if self.ctx.live is None:
            yield None
            return
        record = await self.record_in_flight()
        try:
            yield record
        finally:
            self.release_in_flight()

    async def record_in_flight(self) -> list[dict[str, Any]]:
        """Stop every trajectory where it is, with its tokens (``noria.rollout.in_flight``), and return
        the groups started and not yet in the buffer as plain data: prompt, finished samples, partial
        ones (tokens, logprobs, versions), ``scored`` for a group waiting for buffer room. Nothing
        moves until ``release_in_flight``, so buffer and data cursor read now describe the same
        instant. Needs ``ctx.live``; raises the worker's error."""
        self._recording = True
        try:
            await self.ctx.live.interrupt(self.ctx.engine, self._wait_recorder)
            while not (self.ctx.live.parked == self._unfinished and self._scoring == 0):
                self._raise_error()
                await self._wait_recorder(None)
            self._raise_error()
        except BaseException:
            self.release_in_flight()
            raise
        faults.point("rollout.in_flight_recorded")
        record = [{**group_to_dict(self._in_flight_group(g)), "scored": g in self._putting} for g in sorted(self.pending)]
        return copy.deepcopy(record)  # the samples' lists grow again once released

    def release_in_flight(self) -> None:
        """After the checkpoint: stopped trajectories continue from their tokens, groups start again."""
        self._recording = False
        self.ctx.live.release()
        self._notify()

    def resume_groups(self, groups: list[Group], scored: list[bool]) -> None:
        """Before ``start``: restart groups recorded by ``record_in_flight`` under their ids. Finished
        samples stay; the others continue from their tokens; a scored group goes to the buffer."""
        for group, done in zip(groups, scored):
            if done:
                self._putting[group.group_id] = group
            todo = sum(s.status is Status.PENDING for s in group.samples)
            places = 0 if done else self.n_samples if self.granularity == "group" else todo
            self._launch(group.group_id, group.prompt, list(group.samples[0].prompt_ids), None if done else group.samples, places)

    def resume_point(self) -> tuple[int, list[Prompt]]:
        """Were the run to stop now: the next group id and the prompts of the groups started but not
        in the buffer yet (to go back to the data source). Pending groups at the end of the id range
        give their ids back, so a synchronous run resumed from a checkpoint numbers, and seeds, its
        groups as an uninterrupted one."""
        next_id = self.next_group_id
        while next_id - 1 in self.pending:
            next_id -= 1
        return next_id, [self.pending[g] for g in sorted(self.pending)]

    def metrics(self) -> dict[str, float]:
        """What happened since the last call: tokens, generation rate, engine busy fraction, rewards."""
        stats, self._stats = self._stats, _Interval(busy=self.in_flight > 0)
        out = stats.collect(self.in_flight, len(self.pending), self._stats.start)
        sessions = self.ctx.extra.get("session_counters")  # agent sessions' bounds (noria.agent.session_bounds)
        return {**out, **sessions.metrics()} if sessions is not None else out

    # ------------------------------------------------------------------------------ worker

    def _admissible(self) -> bool:
        places = self.max_in_flight - self.in_flight >= self.n_samples and not self._held and not self._recording
        bound = (self.version() + self.max_staleness + 1) * self.groups_per_step
        return places and self.trained + len(self.buffer) + len(self.pending) < bound

    async def _run(self) -> None:
        try:
            while not self._stopping:
                item = self.next_prompt() if self._admissible() else None
                if item is not None:
                    self._start_group(*item)
                    continue
                if not self.pending and self._admissible():  # nothing to wait for: the data ran out
                    break
                self._wake_worker.clear()
                await self._wake_worker.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the trainer, which raises it
            if not isinstance(e, asyncio.CancelledError):
                self.error = e
            raise
        finally:
            self.finished = True
            self._notify()

    def _start_group(self, prompt: Prompt, ids: list[int]) -> None:
        group_id, self.next_group_id = self.next_group_id, self.next_group_id + 1
        self._launch(group_id, prompt, ids, self._new_samples(group_id, prompt, ids), self.n_samples)

    def _new_samples(self, group_id: int, prompt: Prompt, ids: list[int]) -> tuple[Sample, ...]:
        n, meta = self.n_samples, prompt.metadata
        images = prompt_images(prompt) or None  # a vision-language prompt's images, by content hash
        return tuple(Sample(prompt_ids=list(ids), group_id=group_id, index=i, metadata=dict(meta), images=images) for i in range(n))

    def _launch(self, group_id: int, prompt: Prompt, ids: list[int], samples: tuple[Sample, ...] | None, places: int) -> None:
        self.pending[group_id] = prompt
        if samples is not None and self.rollout_group is None:
            self._samples[group_id] = samples
        self._hold(places)
        task = asyncio.create_task(self._run_group(group_id, prompt, ids))
        self._tasks.add(task)
        task.add_done_callback(self._group_done)

    async def _run_group(self, group_id: int, prompt: Prompt, ids: list[int]) -> None:
        while group_id not in self._putting:  # a resumed group may come scored
            try:
                if self.rollout_group is not None:
                    group, counts = await self._rollout_whole_group(group_id, prompt, ids)
                else:
                    group, counts = await self._generate_group(group_id, prompt)
                self._stats.add(group, counts)
                self._putting[group_id] = group
                if self.observe is not None:
                    self.observe(prompt, [s.reward for s in group.samples if s.status in TRAINABLE and s.reward is not None])
            except EngineLost as lost:  # its places were freed: wait for an engine, then start the group over
                self._stats.regenerated += 1
                self._notify()  # the trainer side restarts engines between waits
                await lost.ready()
                self._hold(self.n_samples)
                self._samples[group_id] = self._new_samples(group_id, prompt, ids)
        await self.buffer.put(self._putting[group_id])  # waits while full; a dropped group went to on_drop
        del self._putting[group_id], self.pending[group_id]  # no await since the put: a record never holds both
        self._notify()

    async def _rollout_whole_group(self, group_id: int, prompt: Prompt, ids: list[int]) -> tuple[Group, ScoreCounts]:
        ctx = dataclasses.replace(self.ctx, prompts={})  # rollout functions write per-call state into it
        try:
            result = await self.rollout_group(ctx, [(prompt, ids)], group_id, self.n_samples, self.reward)
        finally:
            self._hold(-self.n_samples)
        return result.groups[0], result.counts

    async def _generate_group(self, group_id: int, prompt: Prompt) -> tuple[Group, ScoreCounts]:
        """Generate the group's pending samples; with ``reward.score_each_sample`` each is scored as
        soon as it finishes (while the others generate), the rest (all, without it) once all are done."""
        samples = self._samples[group_id]
        early = _EarlyScores(group_id, prompt) if self._score_early else None
        tasks = [asyncio.create_task(self._run_sample(s, early)) for s in samples if s.status is Status.PENDING]
        self._unfinished += len(tasks)  # now: a record waits until each has parked or returned
        try:
            await asyncio.gather(*tasks)
        finally:  # on a failure or cancellation, stop the group's other trajectories too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.granularity == "group":
                self._hold(-self.n_samples)
        del self._samples[group_id]
        group = Group(group_id=group_id, prompt=prompt, samples=samples)
        counts = early.finish() if early is not None else ScoreCounts()
        rest = tuple(s for s in samples if early is None or id(s) not in early.scored)  # resumed ones come finished
        if rest:
            counts.merge(await self._score(Group(group_id=group_id, prompt=prompt, samples=rest)))
        if self.reward.overlong_buffer_tokens:  # DAPO's soft overlong punishment (noria.rewards.shaping)
            shape_overlong(group, counts, self.ctx.sampling.max_new_tokens, self.reward.overlong_buffer_tokens, self.reward.overlong_penalty)
        return group, counts

    async def _run_sample(self, sample: Sample, early: _EarlyScores | None = None) -> None:
        try:
            await self.generate(self.ctx, sample)
        finally:
            self._unfinished -= 1
            if self.granularity == "sample":
                self._hold(-1)
            self._notify()
        if early is not None:  # its place is free already: scoring overlaps the others' generation
            start = early.generated_at = time.perf_counter()
            early.add(sample, await self._score(Group(group_id=early.group_id, prompt=early.prompt, samples=(sample,))), start)

    async def _score(self, group: Group) -> ScoreCounts:
        self._scoring += 1  # a record waits it out: scoring writes into the samples
        try:
            return await score_groups_async([group], self.reward)
        finally:
            self._scoring -= 1
            self._notify()  # a record waiting for the scoring to end looks again

    def _in_flight_group(self, group_id: int) -> Group:
        if group_id in self._putting:
            return self._putting[group_id]
        return Group(group_id=group_id, prompt=self.pending[group_id], samples=self._samples[group_id])

    async def _wait_recorder(self, timeout: float | None) -> None:
        """Until the state of a group or a request changes (or ``timeout`` seconds)."""
        self._wake_recorder.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake_recorder.wait(), timeout)

    def _group_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()
            self._stopping = True
            for other in self._tasks:
                other.cancel()
            if self._worker is not None:
                self._worker.cancel()
        self._notify()

    def _hold(self, places: int) -> None:
        self._stats.busy(self.in_flight, self.in_flight + places)
        self.in_flight += places
        self._notify()

    def _notify(self) -> None:
        self._wake_worker.set()
        self._wake_trainer.set()
        self._wake_recorder.set()

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error


class _EarlyScores:
    """One group's samples scored as each finished: their counts, and how much of the scoring time
    passed while the group was still generating (``ScoreCounts.hidden_seconds``)."""

    def __init__(self, group_id: int, prompt: Prompt) -> None:
        self.group_id, self.prompt = group_id, prompt
        self.scored: set[int] = set()
        self.spans: list[tuple[float, float]] = []
        self.counts = ScoreCounts()
        self.generated_at = 0.0  # when the latest of its samples finished generating

    def add(self, sample: Sample, counts: ScoreCounts, start: float) -> None:
        self.scored.add(id(sample))
        self.spans.append((start, time.perf_counter()))
        self.counts.merge(counts)

    def finish(self) -> ScoreCounts:
        """The counts, with the scoring seconds spent before the group's last sample finished."""
        last = self.generated_at
        self.counts.hidden_seconds = sum(max(0.0, min(end, last) - start) for start, end in self.spans)
        return self.counts


class _Interval:
    """Counters between two ``metrics`` calls; the engine counts as busy while a trajectory is in flight."""

    def __init__(self, busy: bool = False) -> None:
        self.start = time.perf_counter()
        self.busy_since: float | None = self.start if busy else None
        self.busy_s = 0.0
        self.tokens = 0
        self.groups = 0
        self.regenerated = 0
        self.counts = ScoreCounts()

    def busy(self, before: int, after: int) -> None:
        now = time.perf_counter()
        if before == 0 and after > 0:
            self.busy_since = now
        elif before > 0 and after == 0 and self.busy_since is not None:
            self.busy_s += now - self.busy_since
            self.busy_since = None

    def add(self, group: Group, counts: ScoreCounts) -> None:
        self.tokens += sum(len(s.response_ids) for s in group.samples)
        self.groups += 1
        self.counts.merge(counts)

    def collect(self, in_flight: int, pending_groups: int, now: float) -> dict[str, float]:
        busy = self.busy_s + (now - self.busy_since if self.busy_since is not None else 0.0)
        seconds = max(now - self.start, 1e-9)
        out = {
            "rollout/in_flight": float(in_flight),
            "rollout/in_flight_groups": float(pending_groups),
            "rollout/groups_finished": float(self.groups),
            "rollout/groups_regenerated": float(self.regenerated),
            "rollout/tokens": float(self.tokens),
            "rollout/tokens_per_s": self.tokens / seconds,
            "engine/busy_frac": min(busy / seconds, 1.0),
            "time/reward_s": self.counts.seconds,
            "time/reward_hidden_s": self.counts.hidden_seconds,
        }
        out.update({k: float(v) for k, v in self.counts.as_metrics().items()})
        return out
