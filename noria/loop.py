"""The RL loop (DESIGN.md section 1): one function, reading like the algorithm.

    data source --prompts--> rollout scheduler (background: <= N trajectories in flight, engine + reward)
        --groups--> buffer (filters on put, staleness on take) --batch--> trainer
        --train_step x steps_per_rollout--> weight sync (version v -> v+1) --> next step

``rl_loop(job)`` is the whole loop; ``Job`` (``noria.launch.local``) holds the parts and hides the
details behind a handful of calls: ``rollouts``, ``take_groups``, ``train``, ``sync_weights``,
``evaluate``, ``save``. Placement (colocated or disaggregated engine), the sync transport and the
algorithm are configuration, read when the job is built; the loop does not branch on them.

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
bound. Steps: ``step`` counts rollout steps; the weight version equals the number of syncs, so
after step k the engines serve version k. ``train.max_steps`` bounds rollout steps; each takes
``train.steps_per_rollout`` optimizer steps.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from noria.launch.local import Job


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
                sync_metrics = await job.sync_weights()  # engines now serve version job.version
            job.end_step(groups, train_metrics, sync_metrics)
            await job.evaluate(when="step")
            job.save(when="step")
    await job.evaluate(when="end")
    job.save(when="end")
