"""``eval.mode: fleet``: dedicated evaluation engines, loaded from a step's snapshot, versions verified.

What it owns: ``eval.engines`` ``noria serve`` children of the run (``eval-engine-<i>.log``, on
``eval.engine_device``, else the rollout engine's device; one per-run API key), started from the base
model at version 0, and one evaluation at a time on them:

1. load: every engine loads the snapshot folder of step k from disk as weight version ``v`` (the
   run's version after step k) through SGLang's ``/update_weights_from_disk``;
2. verify: every engine must report ``v`` on ``/get_weight_version``, else ``VersionMismatch`` (the
   evaluation is skipped, naming each engine and the version it serves);
3. generate: the held-out prompts are split round-robin over the engines (no router: every request
   goes to an engine that was verified), answers scored with the run's reward;
4. measure: ``mean_version`` = the mean over answers of the mean version of their tokens, and
   ``mixed_version_frac`` = the share of answers whose tokens came from more than one version; the
   row is ``valid`` only when ``mean_version == v`` and no answer is mixed.

Why not ``noria.launch.fleet.EngineFleet`` (the rollout fleet): it routes through sglang-router,
restarts dead engines and pushes weights from the trainer; an evaluation needs none of that, and a
dead evaluation engine only makes its evaluations skipped (the rollout never depends on it).

What blocks on what: one evaluation holds the engines from load to measure (an ``asyncio.Lock``);
a second one in flight waits for it. Loads and version checks run in worker threads.

Not guaranteed: an engine's weights changed by someone else between verify and generate are caught
only by the measured versions (the row is then invalid, not wrong). Evaluation engines take their
own memory and cores; on a small CPU they compete with training.
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noria.eval.modes import EvalHost, Outcome, VersionMismatch, generate_on
from noria.process import Child
from noria.types import Sample


@dataclass
class EvalEngine:
    """One evaluation engine: its process (None when not started by this run), client and weight target."""

    name: str
    process: Child | None
    client: Any
    target: Any


class FleetEval:
    """Evaluation on dedicated engines (module docstring)."""

    def __init__(self, job: EvalHost, engines: list[EvalEngine]) -> None:
        self.job = job
        self.engines = engines
        self.lock = asyncio.Lock()

    @classmethod
    def start(cls, job: EvalHost) -> FleetEval:
        """Start ``eval.engines`` engines of the base model (from the main thread: they die with it)."""
        from noria.console import phase
        from noria.engine.child import engine_device, launch_engine_server
        from noria.models.catalog import model_path

        cfg = job.config
        path, key = model_path(cfg.model.path), secrets.token_urlsafe(32)
        device = cfg.eval.engine_device or engine_device(cfg)
        starting: list[Any] = []
        try:
            with phase(f"starting {cfg.eval.engines} evaluation engine(s) on {device}"):  # launched together, then waited for
                for i in range(cfg.eval.engines):
                    starting.append(launch_engine_server(path, cfg, job.folder, device, f"eval-engine-{i}.log", api_key=key))
                started = [s.ready() for s in starting]
        except BaseException:  # a launch or a start failed: every engine launched is stopped
            for s in starting:
                s.stop()
            raise
        timeout = cfg.rollout.engine_timeout_s
        engines = [connect(f"eval engine {i} ({url})", url, key, child, timeout) for i, (child, url, _) in enumerate(started)]
        return cls(job, engines)

    async def evaluate(self, snapshot: Path, step: int, version: int) -> Outcome:
        async with self.lock:
            await self.load(snapshot, version)
            await self.verify(version)
            samples = await self.generate()
        mean_version, mixed = measure_versions(samples)
        return Outcome(samples, verdict(mean_version, mixed, version))

    async def load(self, snapshot: Path, version: int) -> None:
        """Every engine loads ``snapshot`` as ``version`` (a failure names the engine)."""
        await asyncio.gather(*(asyncio.to_thread(e.target.load_disk, snapshot, version) for e in self.engines))

    async def verify(self, version: int) -> None:
        """``VersionMismatch`` unless every engine reports ``version``."""
        served = await asyncio.gather(*(e.client.weight_version() for e in self.engines))
        wrong = [f"{e.name} serves {v}" for e, v in zip(self.engines, served) if v != version]
        if wrong:
            raise VersionMismatch(f"version mismatch: expected {version} on every evaluation engine; {'; '.join(wrong)}")

    async def generate(self) -> list[Sample]:
        """The held-out prompts split round-robin over the engines; group ids stay the prompts' order."""
        prompts, n = self.job.test_prompts, len(self.engines)
        shards = [(e, prompts[i::n], i) for i, e in enumerate(self.engines) if prompts[i::n]]
        results = await asyncio.gather(*(generate_on(self.job, e.client, shard, first * len(prompts)) for e, shard, first in shards))
        return [s for r in results for s in r]

    def close(self) -> None:
        for e in self.engines:
            e.target.close()
            if e.process is not None:
                e.process.stop(timeout_s=10.0)


def connect(name: str, url: str, key: str | None, process: Child | None, timeout_s: float) -> EvalEngine:
    from noria.rollout import HttpEngineClient
    from noria.sync.targets import HttpEngine

    return EvalEngine(name, process, HttpEngineClient(url, api_key=key, timeout_s=timeout_s, process=process), HttpEngine(url, api_key=key))


def measure_versions(samples: list[Sample]) -> tuple[float | None, float]:
    """(mean over answers of each answer's mean token version, share of answers with several versions).
    Answers without a policy token (aborted before any) are left out; (None, 0.0) when none is left."""
    per_answer = [[v for v, m in zip(s.weight_versions, s.loss_mask) if m] for s in samples]
    per_answer = [vs for vs in per_answer if vs]
    if not per_answer:
        return None, 0.0
    mean_version = statistics.fmean(statistics.fmean(vs) for vs in per_answer)
    mixed = sum(len(set(vs)) > 1 for vs in per_answer) / len(per_answer)
    return mean_version, mixed


def verdict(mean_version: float | None, mixed: float, version: int) -> dict[str, Any]:
    """The row's version fields: valid only when every answer came from ``version`` alone."""
    fields: dict[str, Any] = {"mean_version": mean_version, "mixed_version_frac": mixed}
    if mean_version is None:
        reason = "no answer has a token to measure its version"
    elif mixed > 0:
        reason = f"{mixed:.1%} of answers were generated by mixed weight versions"
    elif mean_version != version:
        reason = f"mean weight version {mean_version:g} of the answers is not the evaluated version {version}"
    else:
        return {**fields, "valid": True}
    return {**fields, "valid": False, "invalid_reason": reason}
