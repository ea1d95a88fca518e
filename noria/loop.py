"""The RL loop (DESIGN.md section 1): one function, reading like the algorithm.

    prompts --rollout (engine + reward)--> groups --buffer (drops, staleness)--> trainer
        --train_step x steps_per_rollout--> weight sync (version v -> v+1) --> next step

``rl_loop(job)`` is the whole loop; ``Job`` (``noria.launch.local``) holds the parts and hides the
details behind a handful of calls: ``rollout``, ``train``, ``sync_weights``, ``evaluate``, ``save``.
Placement (colocated or disaggregated engine), the sync transport and the algorithm are
configuration, read when the job is built; the loop does not branch on them.

Synchronous RL is this loop with ``rollout.max_staleness: 0``: the engine generates a step's groups
with the current weights, then the trainer trains on exactly those groups while the engine waits
(colocated: paused with its KV memory released). Asynchronous RL (generation running ahead while the
trainer works, bounded by staleness) reuses the same calls (issue 6).

Steps: ``step`` counts rollout steps; the weight version equals the number of syncs, so after step
k the engines serve version k. ``train.max_steps`` bounds rollout steps; each takes
``train.steps_per_rollout`` optimizer steps.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from noria.launch.local import Job


async def rl_loop(job: Job) -> None:
    """Run ``job`` from its current step to ``job.total_steps``."""
    await job.evaluate(when="start")
    while job.step < job.total_steps and not job.source.exhausted:
        job.begin_step()
        prompts = job.next_prompts()
        rollout = await job.rollout(prompts)  # every sample of the step, generated and scored
        job.put_groups(rollout.groups)  # drops groups with nothing to train on
        groups = job.take_groups(len(rollout.groups))  # staleness checked against the trainer version
        async with job.trainer_turn():  # colocated: the engine pauses and frees its KV cache
            train_metrics = await asyncio.to_thread(job.train, groups)
            sync_metrics = await job.sync_weights()  # engines now serve version job.version
        job.end_step(rollout, groups, train_metrics, sync_metrics)
        await job.evaluate(when="step")
        job.save(when="step")
    await job.evaluate(when="end")
    job.save(when="end")
