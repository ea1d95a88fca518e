"""The RL loop: one function, reading like the algorithm, over a ``Job`` that launchers implement.

    data source --prompts--> rollout scheduler (background: <= N trajectories in flight, engine + reward)
        --groups--> buffer (filters on put, staleness on take) --batch--> trainer
        --train_step x steps_per_rollout--> weight sync (version v -> v+1) --> next step

``rl_loop(job)`` is the whole loop. ``Job`` (below) is every call it makes; a launcher builds the
parts (engines, trainer ranks, weight sync, buffer, run folder) and implements these calls on them:
``noria.launch.job.LocalJob`` and the jobs that extend it. This module imports no launcher. Placement
(colocated or disaggregated engine), the sync transport and the algorithm are configuration, read
when the job is built; the loop does not branch on them. The training step itself is
``noria.train.rl_step.rl_step``, so every launcher runs the same step.

Synchronous and asynchronous RL are this same loop; ``rollout.max_staleness`` (k) is the only
difference. The scheduler starts a group only while it can still be trained within k weight
versions of the ones generating it, so:

- k = 0 (synchronous): one step's groups are generated with the current weights, the trainer
  trains on exactly those while the engine idles (colocated: paused, KV memory released);
- k >= 1 (asynchronous, disaggregated only): the engine keeps generating the next steps' groups
  while the trainer trains; weights change under running requests (``rollout.pause_mode``), the
  buffer drops a group staler than k, and the loss corrects for the older behaviour policy.

What waits on what: ``take_groups`` waits until a full batch is in the buffer (the trainer's idle
time, ``time/trainer_wait_s``); the scheduler waits for free places, buffer room and the staleness
bound; ``train`` runs in a worker thread while the event loop keeps the rollout going.

Counters: ``step`` counts rollout steps; ``weight_version`` is the number of completed weight
syncs (one per step, so after step k the engines serve version k) and has one owner, the job;
``train.max_steps`` bounds rollout steps, each of which takes ``train.steps_per_rollout``
optimizer steps (the backend's ``optimizer_steps``, another number).
"""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from typing import Literal, Protocol

from noria.types import Group

When = Literal["start", "step", "end"]


class Job(Protocol):
    """Every call ``rl_loop`` makes, in the order it makes them; a launcher implements it.

    The calls run on one asyncio event loop, except ``train``, which the loop runs in a worker
    thread (the rollout keeps going meanwhile, unless the engine is paused for the trainer)."""

    step: int
    """Rollout steps completed (the loop stops at ``total_steps``); ``end_step`` advances it."""
    total_steps: int
    """Rollout steps of the run: ``train.max_steps``, or what ``data.epochs`` of the prompts fill."""
    weight_version: int
    """The number of completed weight syncs: the version the engines serve. Only ``sync_weights``
    changes it; the scheduler, the buffer and checkpoints read it from here."""

    def rollouts(self) -> AbstractAsyncContextManager[None]:
        """The rollout scheduler generates and scores groups in the background for the body; on
        exit it stops, cancels what is in flight and returns those prompts to the data source."""
        ...

    async def take_groups(self) -> list[Group]:
        """One training batch (``rollout.prompts_per_step`` groups, staleness checked against
        ``weight_version``), waiting for the rollout as long as it takes; fewer only when the data
        ran out (empty: the run is over). Raises what stopped the rollout (an engine failure)."""
        ...

    def trainer_turn(self) -> AbstractAsyncContextManager[None]:
        """The trainer's turn: a colocated engine pauses and frees its KV memory for the body; a
        disaggregated one keeps generating."""
        ...

    def train(self, groups: list[Group]) -> dict[str, float]:
        """The RL step (``noria.train.rl_step``) on every trainer rank; blocks until done (the loop
        runs it in a thread). Returns the step's metrics."""
        ...

    async def sync_weights(self) -> dict[str, float]:
        """Push the trainer's weights to every engine as ``weight_version + 1``, then advance
        ``weight_version``; waits until every engine has committed (generation pauses meanwhile
        per ``rollout.pause_mode``). Returns the push's metrics."""
        ...

    async def evaluate(self, when: When) -> None:
        """Held-out accuracy if due at ``when`` (``eval.every``); a failure is logged as skipped,
        never raised, except an engine failure."""
        ...

    async def save(self, when: Literal["step", "end"]) -> None:
        """A checkpoint if due (every ``train.save_every`` steps; at the end too, so a finished run can
        be extended, unless ``train.save_final_state`` is off); at the end, the final model too. Asynchronous: the
        requests in flight may be stopped with their tokens for it and recorded
        (``rollout.resume_in_flight``), then continued."""
        ...

    def begin_step(self) -> None:
        """Start timing a rollout step."""
        ...

    def end_step(self, groups: list[Group], train_metrics: dict[str, float], sync_metrics: dict[str, float]) -> None:
        """Advance ``step`` and write its metrics line and trajectories."""
        ...


async def rl_loop(job: Job) -> None:
    """Run ``job`` from its current step to ``job.total_steps`` (or until the data runs out)."""
    await job.evaluate(when="start")
    async with job.rollouts():  # the scheduler generates and scores in the background from here on
        while job.step < job.total_steps:
            job.begin_step()
            groups = await job.take_groups()  # one training batch; staleness checked against the trainer
            if not groups:
                break  # the data source ran out
            async with job.trainer_turn():  # colocated: the engine pauses and frees its KV cache
                train_metrics = await asyncio.to_thread(job.train, groups)
                sync_metrics = await job.sync_weights()  # engines now serve version job.weight_version
            job.end_step(groups, train_metrics, sync_metrics)
            await job.evaluate(when="step")
            await job.save(when="step")
    await job.evaluate(when="end")
    await job.save(when="end")
