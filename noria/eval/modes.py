"""Evaluation during an RL run: when it is due, where it runs (``eval.mode``), and what is recorded.

What this module owns: ``Evaluations``, the RL job's evaluator (``LocalJob.evaluate`` calls it after
each step, before step 1 and at the end), and the eval.jsonl row of every evaluation::

    step k ends, eval due (eval.every)
      shared:      generate on the rollout engines now, no rollout group starting meanwhile;
                   the loop waits                                            -> row (lag 0 steps)
      fleet:       export snapshot k (the loop waits for the export)       -> background task:
                   load it on every eval engine, verify each serves k, generate, measure versions -> row
      checkpoint:  export snapshot k (the loop waits for the export)       -> background task:
                   eval.backend.evaluate(folder) in a worker thread, answers scored here -> row

Every row names the step whose weights it measured (``step``, and ``version``: the weight version
after that step), ``mode``, the delay until its score existed: ``lag_steps`` (steps trained
meanwhile) and ``lag_s`` (seconds since step k ended), and what it cost the training loop:
``loop_wait_s`` (shared: the whole evaluation; otherwise the wait for room and the export). Rows are written when they finish, so in
fleet and checkpoint modes eval.jsonl is not in step order.

In flight: an evaluation counts from its export until its row is written. At most
``eval.max_in_flight``; one more due is, per ``eval.overflow``, waited for (the loop waits until the
oldest finishes) or skipped. Skipped (a row with ``skipped``: the reason, never raised): export
failed, missing snapshot, too many in flight, backend error, version mismatch (an eval engine not
serving k before generation), any engine failure of the eval fleet. Invalid (a row with its
accuracy and ``valid: false``, ``invalid_reason``): the fleet's answers were not all produced by
version k (``mean_version`` != k or ``mixed_version_frac`` > 0); the report leaves such rows out.

What blocks on what: the export runs in a worker thread between steps (the rollout keeps going in
asynchronous RL; the trainer is idle); evaluation tasks run on the loop's event loop (fleet) or in a
daemon thread (checkpoint), beside the rollout. At the end of the run every evaluation in flight is
awaited before the final row is written.

Not guaranteed: shared mode holds the rollout scheduler (no group starts) while it evaluates, but
groups already generating finish beside the evaluation on the same engines. An evaluation cut off by the
end of the run (Ctrl-C, an error) writes no row.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from noria.config import RewardConfig, RunConfig
from noria.errors import NoriaError
from noria.metrics import RunLog
from noria.rollout.client import EngineClient
from noria.train.backend import TrainBackend
from noria.types import Prompt, Sample, Status


class EvalHost(Protocol):
    """What the evaluator needs of the RL job. Defined here, in the lower layer, and implemented by
    the job (``noria.launch.job.LocalJob``), so that evaluation imports no launcher."""

    config: RunConfig
    """The run's config: ``eval`` (when, where, how), ``rollout`` (sampling), ``model`` (the fleet's engines)."""
    folder: Path
    """The run folder: snapshots and fleet logs go under it."""
    step: int
    """Rollout steps completed: the step whose weights an evaluation measures."""
    total_steps: int
    weight_version: int
    """The version the engines serve after ``step``."""
    log: RunLog
    """Where eval.jsonl rows go (``write_eval``)."""
    backend: TrainBackend
    """The trainer: a snapshot is its ``export_hf`` (fleet and checkpoint modes)."""
    client: EngineClient
    """The rollout engines (shared mode generates on them)."""
    tokenizer: Any
    """The policy's tokenizer (a transformers tokenizer; None for an image model)."""
    processor: Any
    """A vision-language policy's processor (agent sessions render images with it), else None."""
    test_prompts: list[tuple[Prompt, list[int]]]
    """The held-out prompts and their rendered token ids."""
    reward: RewardConfig
    """The run's reward (its ``name`` resolved), which scores the answers."""

    def hold_rollout(self, held: bool) -> None:
        """While held, the rollout starts no new group (shared mode evaluates on the same engines)."""
        ...


class VersionMismatch(NoriaError):
    """An evaluation engine does not serve the version being evaluated."""


@dataclass
class Outcome:
    """What one evaluation produced: its scored answers and mode-specific fields of its row."""

    samples: list[Sample]
    fields: dict[str, Any] = field(default_factory=dict)


class Runner(Protocol):
    """A background evaluation mode (fleet, checkpoint)."""

    async def evaluate(self, snapshot: Path, step: int, version: int) -> Outcome: ...

    def close(self) -> None: ...


class Evaluations:
    """The RL job's evaluator: ``await evaluate(when)`` after each loop point; ``close()`` at the end."""

    def __init__(self, job: EvalHost, runner: Runner | None = None, last_step: int | None = None) -> None:
        self.job = job
        self.cfg = job.config.eval
        self.runner = runner
        self.in_flight: set[asyncio.Task] = set()
        self.last_step = last_step

    @classmethod
    def build(cls, job: EvalHost) -> Evaluations:
        """The evaluator of ``job``'s ``eval.mode`` (fleet engines started, the backend built, here)."""
        cfg = job.config.eval
        if cfg.every <= 0 or cfg.mode == "shared":
            return cls(job)
        if cfg.mode == "fleet":
            from noria.eval.fleet import FleetEval

            return cls(job, FleetEval.start(job))
        from noria.eval.checkpoint import CheckpointEval

        return cls(job, CheckpointEval(job))

    def due(self, when: str) -> bool:
        j, every = self.job, self.cfg.every
        if every <= 0 or not j.test_prompts or self.last_step == j.step:
            return False
        return {"start": j.step == 0, "step": j.step % every == 0 and j.step < j.total_steps, "end": True}[when]

    async def evaluate(self, when: str) -> None:
        """Evaluate the current weights if due at ``when``; at the end, wait for every one in flight."""
        if self.due(when):
            self.last_step = self.job.step
            if self.runner is None:
                await self.shared(self.job.step, self.job.weight_version)
            else:
                await self.start(self.job.step, self.job.weight_version)
        if when == "end":
            await self.drain()

    async def shared(self, step: int, version: int) -> None:
        """On the rollout engines now (an engine failure propagates: the rollout needs that engine too)."""
        from noria.console import phase
        from noria.rollout import EngineFailure

        start = time.perf_counter()
        self.job.hold_rollout(True)  # no rollout group starts while the engines evaluate
        try:
            with phase(f"eval at step {step} on {len(self.job.test_prompts)} held-out prompts", end_line=False):
                samples = await generate_on(self.job, self.job.client, self.job.test_prompts, 0)
        except EngineFailure:
            raise
        except Exception as e:  # an evaluation failure never stops training
            self.skip(step, version, start, f"{type(e).__name__}: {e}")
            return
        finally:
            self.job.hold_rollout(False)
        self.record(step, version, start, start, Outcome(samples, {"loop_wait_s": time.perf_counter() - start}))

    async def start(self, step: int, version: int) -> None:
        """Export snapshot ``step`` and evaluate it in the background (or skip, per eval.overflow)."""
        from noria.eval.snapshot import export_snapshot

        start = time.perf_counter()
        if not await self.room(step, version, start):
            return
        try:
            snapshot = await asyncio.to_thread(export_snapshot, self.job.backend, self.job.folder, step)
        except Exception as e:  # the trainer's export; training goes on without this evaluation
            self.skip(step, version, start, f"export failed: {type(e).__name__}: {e}")
            return
        waited = time.perf_counter() - start  # for room (overflow: wait) and the export
        task = asyncio.create_task(self.measure(step, version, snapshot, start, waited), name=f"eval step {step}")
        self.in_flight.add(task)
        task.add_done_callback(self.in_flight.discard)

    async def room(self, step: int, version: int, start: float) -> bool:
        """Whether another evaluation may start now, waiting for one to finish under overflow: wait."""
        while len(self.in_flight) >= self.cfg.max_in_flight:
            if self.cfg.overflow == "skip":
                reason = f"too many in flight: {len(self.in_flight)} evaluations outstanding (eval.max_in_flight={self.cfg.max_in_flight})"
                self.skip(step, version, start, reason)
                return False
            await asyncio.wait(set(self.in_flight), return_when=asyncio.FIRST_COMPLETED)
        return True

    async def measure(self, step: int, version: int, snapshot: Path, start: float, loop_wait_s: float) -> None:
        from noria.eval.snapshot import SnapshotError, check_snapshot, remove_snapshot

        began = time.perf_counter()
        try:
            check_snapshot(snapshot)
            outcome = await self.runner.evaluate(snapshot, step, version)
        except (SnapshotError, VersionMismatch) as e:
            self.skip(step, version, start, str(e))
            return
        except Exception as e:  # a backend or eval-engine failure never stops training
            self.skip(step, version, start, f"{self.cfg.mode} error: {type(e).__name__}: {e}")
            return
        finally:
            remove_snapshot(snapshot)
        outcome.fields["loop_wait_s"] = loop_wait_s
        self.record(step, version, start, began, outcome)

    async def drain(self) -> None:
        """Wait for every evaluation in flight (their rows are written by then)."""
        while self.in_flight:
            await asyncio.gather(*list(self.in_flight), return_exceptions=True)

    def close(self) -> None:
        """Cancel what is in flight and stop the mode's engines."""
        for task in list(self.in_flight):
            task.cancel()
        if self.runner is not None:
            self.runner.close()

    # ------------------------------------------------------------------------------ rows

    def lag(self, step: int, start: float) -> dict[str, Any]:
        return {"mode": self.cfg.mode, "lag_steps": self.job.step - step, "lag_s": time.perf_counter() - start}

    def skip(self, step: int, version: int, start: float, reason: str) -> None:
        self.job.log.write_eval({"step": step, "version": version, **self.lag(step, start), "skipped": reason})

    def record(self, step: int, version: int, start: float, began: float, outcome: Outcome) -> None:
        """The row of a finished evaluation: ``seconds`` from ``began`` (its own work), lag from ``start``
        (the end of step ``step``)."""
        from noria.eval.answer_grid import save_answer_grid
        from noria.eval.runner import accuracy, check_scored

        samples = outcome.samples
        try:
            check_scored(samples, f"evaluation at step {step}")
        except NoriaError as e:  # logged (and printed) as skipped; an evaluation never stops training
            self.job.log.write_eval({"step": step, "version": version, **self.lag(step, start), "skipped": str(e)}, samples)
            return
        row = {
            "step": step,
            "version": version,
            "accuracy": accuracy(samples),
            "n_prompts": len({s.group_id for s in samples}),
            "n_answers": len(samples),
            "failed": sum(s.reward is None for s in samples),
            "truncated": sum(s.status is Status.TRUNCATED for s in samples),
            "seconds": time.perf_counter() - began,
            **self.lag(step, start),
            **outcome.fields,
        }
        self.job.log.write_eval(row, samples)
        save_answer_grid(samples, self.job.folder / "eval" / f"step-{step:06d}.png")  # a vision-language run's picture


async def generate_on(job: EvalHost, client: Any, prompts: list[Any], first_group_id: int) -> list[Sample]:
    """The held-out answers of ``prompts`` from ``client``'s engine, scored with the run's reward."""
    from noria.rollout import RolloutContext
    from noria.rollout.generate import run_rollout

    e = job.config.eval
    ctx = RolloutContext(client, job.tokenizer, eval_sampling(job.config), seed=e.seed, greedy=e.temperature == 0,
                         processor=job.processor, max_groups=e.batch_size)
    from noria.rewards.registry import eval_reward

    result = await run_rollout(ctx, prompts, first_group_id, e.n_samples, eval_reward(job.reward))  # a judge's run: the rule
    return [s for g in result.groups for s in g.samples]


def eval_sampling(config: Any) -> Any:
    """The rollout section with the evaluation's sampling (``eval.max_new_tokens``, temperature, top_p)."""
    import dataclasses

    e = config.eval
    return dataclasses.replace(config.rollout, max_new_tokens=e.max_new_tokens, temperature=e.temperature, top_p=e.top_p, top_k=-1, min_p=0.0)
