"""The local launcher: builds an RL job on one machine (``LocalJob``, a ``noria.loop.Job``) and runs
``noria.loop.rl_loop`` on it.

What it owns: turning a ``RunConfig`` into running parts, and the parts' per-step bookkeeping:

- data: the task's (or file's) train and test prompts, rendered once; too-long ones dropped;
- the engine, by ``rollout.placement``: ``colocated`` builds the built-in ``Engine`` in this
  process (it pauses and releases its KV memory while the trainer runs); ``disaggregated`` starts
  ``noria serve`` as a child process on a free loopback port (on ``rollout.engine_device``, else
  ``model.device``; the trainer stays on ``train.device``, so engine and trainer may hold one GPU
  each), or uses ``rollout.engine_url``;
- the trainer backend (``FSDPBackend``, one process), the weight sync (``noria.sync``), the group
  buffer, and the run folder (config.yaml, metrics.jsonl, eval.jsonl, checkpoints/, final/);
- the rollout scheduler (``noria.rollout.scheduler``), a background task on the loop's event loop
  that keeps trajectories in flight and fills the buffer while the trainer computes in a thread.
  ``rollout.max_staleness`` bounds how far it runs ahead (0: synchronous RL);
- the weight version (``weight_version``, the number of completed syncs): this job owns it; the
  scheduler reads it through a callable, the buffer gets it per take, checkpoints store it once.
  The training step is ``noria.train.rl_step`` (every launcher runs the same one).

Weight updates: a disaggregated engine is paused around each push (``rollout.pause_mode``: retract
or in place); a colocated one is already paused, its KV memory released, for the trainer's turn.
The ``broadcast`` transport's group (``sync.broadcast_backend: auto``) is NCCL when the trainer is
on a GPU and the engine on another one, gloo otherwise (both on one GPU: NCCL refuses two ranks
on one device, so the CUDA weights go through host memory).

Child processes get this process's environment with NVLink multicast off (``noria.launch.env``).
The ``noria serve`` child is started with a per-run API key (in its environment, never on its
command line) that every request and weight push carries, and dies with this process
(``noria.launch.lifecycle``); a group generated with a weight version this run never pushed stops
the run (``check_served_versions``). A run that can train nothing stops with an error naming why
(``rollout.buffer.max_consecutive_drops``, ``DropStreak``).

Order of checks: the config is validated when loaded; prompts, reward and run folder are checked
here before any model loads, so a bad input costs seconds, not a model load.

Resume (``--resume RUN_DIR``): the last committed checkpoint restores weights, AdamW, RNG, the data
cursor (with the prompts of groups that were still generating put back first), the buffer's waiting
groups, the step, the group counter, the count of trained groups and the weight version; the engine, started from
the base model, receives the checkpoint's weights under that version before the first rollout, and
metrics lines after the checkpoint are dropped so the resumed run repeats exactly the same steps.

Several engines (``rollout.engines``) or trainer processes (``train.world_size``) run on
``noria.launch.scaled.ScaledJob``, and ``launch: ray`` on ``noria.launch.ray.RayJob``: both are this
job with other parts (``run_rl`` picks the class). Not guaranteed: a colocated engine shares this process's CPU threads with the
trainer (they never run at the same time in synchronous RL).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import fields
from pathlib import Path
from typing import Any

from noria.config import RunConfig, ensure_valid, save_config
from noria.console import phase
from noria.errors import NoriaError
from noria.launch.env import child_env
from noria.launch.lifecycle import die_with_parent, signals_cancel_task
from noria.metrics import RunLog, mean
from noria.rollout import EngineFailure, HttpEngineClient, LocalEngineClient, RolloutContext
from noria.rollout.buffer import DropStreak, build_buffer, prompt_to_dict, resolve_filters
from noria.rollout.generate import generate_one, run_rollout  # run_rollout: the plug-in layers (noria.agent)
from noria.rollout.scheduler import RolloutScheduler
from noria.train.rl_step import on_device, rl_step
from noria.types import Group, Prompt, Status

SERVE_READY_TIMEOUT_S = 600.0


def run_rl(
    config: RunConfig, run_dir: str | None = None, resume: str | None = None, progress: bool | None = None,
    job_class: type[LocalJob] | None = None,
) -> Path:
    """``noria train`` for ``train.algorithm: rl``: build the job, run the loop, clean up.
    ``job_class``: a ``LocalJob`` of another model family (``noria.diffusion.job.DiffusionJob``)."""
    from noria.loop import rl_loop
    from noria.run_folder import discard_unstarted, resolve_run_dir

    folder = resolve_run_dir(config, run_dir, resume)  # once: the default name holds the time
    with discard_unstarted(folder, resume is not None):  # a run that fails before step 1 leaves no folder
        job = (job_class or job_class_for(config)).build(config, None if resume else str(folder), resume, progress)
        try:
            asyncio.run(job.run(rl_loop))
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (noria.launch.lifecycle): say where the run stands
            why = str(e) or "interrupted (Ctrl-C)"
            print(f"noria train: {why} after step {job.step}; {job.resume_hint()}", file=sys.stderr, flush=True)
            raise
        finally:
            job.close()
    return job.folder


def job_class_for(config: RunConfig) -> type[LocalJob]:
    """The job a config asks for: ``launch: ray`` (``noria.launch.ray.RayJob``), an engine fleet or
    several trainer ranks on this machine (``noria.launch.scaled.ScaledJob``), else ``LocalJob``."""
    if config.launch == "ray":
        from noria.launch.ray import RayJob

        return RayJob
    if config.rollout.engines > 1 or config.train.world_size > 1:
        from noria.launch.scaled import ScaledJob

        return ScaledJob
    return LocalJob


class LocalJob:
    """The parts of one RL run on this machine and the calls the loop makes on them: a
    ``noria.loop.Job`` (the protocol documents each call)."""

    # ------------------------------------------------------------------------------------ build

    @classmethod
    def build(cls, config: RunConfig, run_dir: str | None, resume: str | None, progress: bool | None) -> LocalJob:
        from noria.run_folder import check_run_folder, resolve_run_dir

        cls.check_supported(config)
        folder = resolve_run_dir(config, run_dir, resume)
        check_run_folder(folder, config, resume is not None)
        job = cls(config, folder, progress)
        with phase("reading the prompts and the tokenizer"):
            job.load_data()  # prompts and reward are checked before any model loads
        job.start_parts(resume is not None)
        return job

    @staticmethod
    def check_supported(config: RunConfig) -> None:
        check_supported(config)

    def __init__(self, config: RunConfig, folder: Path, progress: bool | None) -> None:
        from noria.rewards.registry import resolve_reward

        self.config = config
        self.folder = folder
        self.progress = progress
        self.reward = resolve_reward(config)
        self.step = 0
        self.next_group_id = 0
        self.weight_version = 0
        """The number of completed weight syncs: the version the engines serve (``noria.loop.Job``)."""
        self.total_steps = 0
        self.trained_groups = 0
        r = config.rollout
        self.buffer = build_buffer(
            r.buffer.impl, capacity=r.buffer.capacity_batches * r.prompts_per_step, max_staleness=r.max_staleness,
            filters=resolve_filters(r.buffer.filters), on_drop=self.on_drop,
        )  # fmt: skip
        self.drops = DropStreak(r.buffer.max_consecutive_drops)
        self.scheduler: RolloutScheduler | None = None
        self.engine_process: subprocess.Popen | None = None
        self.local_engine: Any = None
        self.client: Any = None
        self.backend: Any = None
        self.sync: Any = None
        self.log: RunLog | None = None
        self.teacher: Any = None
        """On-policy distillation with teacher engines (``noria.distill.teacher.EngineTeacher``), or None."""
        self.teacher_process: subprocess.Popen | None = None
        from noria.eval.modes import Evaluations

        self.evals = Evaluations(self)
        """The evaluator (``noria.eval.modes.Evaluations``): shared mode until ``start_parts`` builds the configured one."""
        self.timer: dict[str, float] = {}

    def load_data(self) -> None:
        from noria.data import PromptSource, drop_long, load_prompts, render_prompts
        from noria.data.chat import check_fit
        from noria.models import load_tokenizer
        from noria.models.catalog import model_path
        from noria.rewards.registry import get_reward

        cfg = self.config
        get_reward(self.reward.name)  # an unknown reward or a bad import path fails here (PluginError)
        self.tokenizer = load_tokenizer(model_path(cfg.model.path))
        train = render_prompts(load_prompts(cfg.data, "train"), self.tokenizer, cfg.data.chat_template, cfg.data.system_prompt)
        kept, dropped = drop_long(train, cfg.data.max_prompt_tokens)
        if not kept:
            raise NoriaError(f"no training prompts left ({len(train)} loaded, {dropped} over data.max_prompt_tokens)")
        check_fit(kept, context_limit(cfg), cfg.data.max_prompt_tokens)
        check_teacher_tokenizer(cfg, self.tokenizer)  # before any model loads
        self.prompt_ids = {r.prompt.index: r.ids for r in kept}
        self.source = PromptSource.from_config([r.prompt for r in kept], cfg.data)
        self.dropped_prompts = dropped
        self.test_prompts: list[tuple[Prompt, list[int]]] = []
        if cfg.eval.every > 0:
            test = load_prompts(cfg.data, "test")[: cfg.eval.limit]
            rendered = render_prompts(test, self.tokenizer, cfg.data.chat_template, cfg.data.system_prompt)
            fit = drop_long(rendered, cfg.data.max_prompt_tokens)[0]
            check_fit(fit, context_limit(cfg), cfg.data.max_prompt_tokens)
            self.test_prompts = [(r.prompt, r.ids) for r in fit]
        per_epoch = len(kept) * cfg.data.epochs // cfg.rollout.prompts_per_step
        self.total_steps = min(per_epoch, cfg.train.max_steps) if cfg.train.max_steps else per_epoch
        if self.total_steps < 1:
            raise NoriaError(
                f"{len(kept)} training prompts x {cfg.data.epochs} epochs do not fill one step of "
                f"rollout.prompts_per_step={cfg.rollout.prompts_per_step}"
            )

    def start_parts(self, resume: bool) -> None:
        from noria.models.catalog import model_path
        from noria.models.hf import disable_dropout
        from noria.train import build_backend

        from noria.eval.modes import Evaluations

        cfg = self.config
        path = model_path(cfg.model.path)
        self.evals = Evaluations.build(self)  # eval.mode fleet: its engines; checkpoint: its backend
        with phase(f"starting the rollout engine ({cfg.rollout.placement}) with {path} ({cfg.model.dtype}, {cfg.model.device})"):
            self.client, target = self.start_engine(path)
        self.start_teacher()
        with phase(f"loading the trainer's copy of the model ({cfg.train.param_dtype}, {cfg.train.device})"):
            self.backend = build_backend(cfg.train, model_impl=cfg.model.impl, seed=cfg.seed, **backend_options(cfg))
            self.backend.init(path, total_steps=self.total_steps * cfg.train.steps_per_rollout)
            disable_dropout(self.backend.lm)  # transformers' models (GPT-2...): train what the engine sampled from
        self.critic = None
        if cfg.train.loss.advantage == "gae":  # PPO: a value model gives per-token advantages
            from noria.train.critic import CriticBackend

            self.critic = CriticBackend(cfg.train, seed=cfg.seed)
            self.critic.init(path, total_steps=self.total_steps * cfg.train.steps_per_rollout)
        self.sync = build_weight_sync(cfg, target, self.folder)
        if resume:
            self.restore()
        cfg.run_dir = str(self.folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.folder / "config.yaml")
        self.log = RunLog(self.folder, self.total_steps, self.step, self.progress, config=cfg)

    def start_engine(self, path: Path) -> tuple[Any, Any]:
        """(the client rollout uses, the target weight sync pushes to)."""
        cfg = self.config
        timeout = cfg.rollout.engine_timeout_s
        if cfg.rollout.placement == "colocated":
            from noria.engine import in_process_engine

            m = cfg.model
            self.local_engine = in_process_engine(path, cfg.engine, m.impl, m.dtype, m.device, cfg.seed)
            return LocalEngineClient(self.local_engine, timeout), self.local_engine
        from noria.engine import serves_natively
        from noria.sync.targets import HttpEngine

        if cfg.rollout.engine == "vllm":  # a vLLM OpenAI server (noria.launch.external)
            from noria.launch.external import start_vllm_engine

            self.engine_process, client, target = start_vllm_engine(path, cfg, self.folder)
            return client, target
        if cfg.rollout.engine_url is None and not serves_natively(path, cfg.model.impl):
            raise NoriaError(
                f"{cfg.model.path}: the generic transformers engine (model.impl: hf, or a family with no native model) "
                "runs in process only: set rollout.placement: colocated"
            )

        url, key = cfg.rollout.engine_url, None
        if url is None:
            self.engine_process, url, key = start_server(path, cfg, self.folder)
        from noria.launch.external import check_engine

        check_engine(cfg, url, key)  # a config needing what the engine lacks stops here, before the trainer loads
        return HttpEngineClient(url, api_key=key, timeout_s=timeout, process=self.engine_process), HttpEngine(url, api_key=key)

    def start_teacher(self) -> None:
        """``opd.placement: engine``: the teacher engines (a ``noria serve`` of ``opd.teacher`` the
        run starts, or the servers at ``opd.teacher_url`` / ``opd.teachers``, tokenizers checked)."""
        from noria.distill.teacher import EngineTeacher, check_tokenizers, teacher_tokenizer
        from noria.models.catalog import model_path

        cfg, opd = self.config, self.config.opd
        if cfg.train.loss.opd_coef <= 0 or opd.placement != "engine":
            return
        urls: dict[str | None, str] = dict(opd.teachers) or ({None: opd.teacher_url} if opd.teacher_url else {})
        keys: dict[str | None, str] = {}
        for value, url in urls.items():
            tokenizer, path = teacher_tokenizer(url)
            check_tokenizers(self.tokenizer, tokenizer, f"{path} (at {url})", cfg.model.path)
        if not urls:
            device = opd.teacher_device or engine_device(cfg)
            self.teacher_process, url, keys[None] = start_server(model_path(opd.teacher), cfg, self.folder, device, "teacher.log")
            urls = {None: url}
        timeout = cfg.rollout.engine_timeout_s
        clients = {v: HttpEngineClient(u, api_key=keys.get(v), timeout_s=timeout, process=self.teacher_process) for v, u in urls.items()}
        self.teacher = EngineTeacher(clients, opd.teacher_key, cfg.rollout.temperature, opd.top_k)

    # ------------------------------------------------------------------------------------ loop calls

    async def run(self, loop_fn: Any) -> None:
        with signals_cancel_task():  # SIGTERM and Ctrl-C stop the loop at an await
            if self.step > 0 or self.weight_version > 0:  # resumed: the engine still serves the base model
                await self.sync_weights(advance=False)
            await loop_fn(self)
        self.log.close()
        print(f"noria train: {self.step} steps; model in {self.folder / 'final'}", file=sys.stderr)

    def resume_hint(self) -> str:
        from noria.train import latest_checkpoint

        ckpt = latest_checkpoint(self.folder)
        if ckpt is None:
            return f"no checkpoint was committed in {self.folder}"
        return f"continue from {ckpt.name} with: noria train CONFIG --resume {self.folder}"

    def begin_step(self) -> None:
        self.timer = {"start": time.perf_counter()}

    def next_prompt(self) -> tuple[Prompt, list[int]] | None:
        batch = self.source.next_batch(1)
        return (batch[0], self.prompt_ids[batch[0].index]) if batch else None

    def on_drop(self, group: Group, reason: str) -> None:
        """A group the buffer dropped: its prompt returns or goes; too many in a row stop the run."""
        if self.config.rollout.buffer.on_drop == "return":
            self.source.return_prompt(group.prompt)
        self.drops.dropped(group, reason)

    @contextlib.asynccontextmanager
    async def rollouts(self) -> AsyncIterator[None]:
        """The rollout scheduler runs in the background for the body; then it drains (in-flight work is
        cancelled and its prompts go back to the data source)."""
        r = self.config.rollout
        ctx = RolloutContext(self.client, self.tokenizer, r, seed=self.config.seed, top_logprobs=self.teacher.top_k if self.teacher else 0)
        self.scheduler = RolloutScheduler(
            ctx, self.next_prompt, self.buffer, self.reward, n_samples=r.n_samples, groups_per_step=r.prompts_per_step,
            max_staleness=r.max_staleness, max_in_flight=r.max_in_flight or r.prompts_per_step * r.n_samples,
            granularity=granularity(r), next_group_id=self.next_group_id, version=lambda: self.weight_version,
            trained=self.trained_groups, **self.rollout_plugin(),
        )  # fmt: skip
        self.scheduler.start()
        try:
            yield
        finally:
            await self.scheduler.close()
            self.next_group_id, unfinished = self.scheduler.resume_point()
            for prompt in unfinished:
                self.source.return_prompt(prompt)
            self.scheduler = None

    def rollout_plugin(self) -> dict[str, Any]:
        """How the scheduler produces a group (``rollout_plugin``); a job of another model family
        (``noria.diffusion.job``) gives its own generate function here."""
        plugin = rollout_plugin(self.config.rollout)
        if self.teacher is not None:  # on-policy distillation: teacher engines score each finished sample
            from noria.distill.teacher import with_teacher

            plugin = with_teacher(plugin, self.teacher)
        return plugin

    async def take_groups(self) -> list[Group]:
        """One training batch (``prompts_per_step`` groups, by group id), waiting for the rollout as long
        as it takes; fewer only when the data source ran out. Staleness is checked by the buffer here."""
        n, scheduler = self.config.rollout.prompts_per_step, self.scheduler
        start = time.perf_counter()
        groups: list[Group] = []
        while True:
            await self.between_waits()  # before the look at the buffer: nothing may await between it and wait_change
            taken = self.buffer.take(n - len(groups), self.weight_version)
            scheduler.on_taken(len(taken))  # at once: the scheduler's staleness bound counts them
            if taken:
                self.drops.trained()
            groups += taken
            if len(groups) == n or scheduler.finished:
                break
            await scheduler.wait_change()
        if scheduler.error is not None:  # it stopped on a failure: never train on what it left behind
            raise scheduler.error
        if not groups and self.step == 0:
            raise NoriaError(f"the data ran out before one group could be trained: {self.drops.describe()}")
        check_served_versions(groups, self.weight_version)
        self.trained_groups += len(groups)
        self.timer["wait"] = time.perf_counter() - start
        return sorted(groups, key=lambda g: g.group_id)

    async def between_waits(self) -> None:
        """While ``take_groups`` waits for the rollout (the trainer is idle): a launcher with an engine
        fleet restarts dead engines here (``noria.launch.scaled``); one engine has nothing to do."""

    @contextlib.asynccontextmanager
    async def trainer_turn(self) -> AsyncIterator[None]:
        """Colocated: pause the engine (requests retracted) and release its KV memory meanwhile; the
        scheduler starts no group until the engine is back (its arrival order stays that of a fresh step)."""
        if self.config.rollout.placement != "colocated":
            yield
            return
        self.scheduler.hold(True)
        await self.client.pause()
        await self.client.release_memory()
        try:
            yield
        finally:
            await self.client.resume_memory()
            await self.client.resume()
            self.scheduler.hold(False)

    def train(self, groups: list[Group]) -> dict[str, float]:
        """``steps_per_rollout`` optimizer steps on the groups' trainable samples (``noria.train.rl_step``)."""
        cfg = self.config
        opd = cfg.opd if cfg.train.loss.opd_coef > 0 else None
        return rl_step(self.backend, groups, cfg.train, self.weight_version, self.critic, cfg.rollout.routing_replay, opd)

    async def sync_weights(self, advance: bool = True) -> dict[str, float]:
        """Push the trainer's weights to the engines as the next version (or, resuming, the current
        one), then count the sync: ``weight_version`` changes here and nowhere else."""
        version = self.weight_version + 1 if advance else self.weight_version
        bucket = self.config.sync.bucket_mb << 20
        async with self.generation_paused():
            metrics = await asyncio.to_thread(self.push, version, bucket)
        self.weight_version = version
        if self.scheduler is not None:
            self.scheduler.on_new_version()
        return metrics

    def push(self, version: int, bucket_bytes: int) -> dict[str, float]:
        with on_device(self.backend.device):
            return self.sync.push(self.backend.state_dict_for_sync(bucket_bytes, cast=not self.sync.casts_on_write), version)

    @contextlib.asynccontextmanager
    async def generation_paused(self) -> AsyncIterator[None]:
        """A disaggregated engine generating meanwhile pauses (``rollout.pause_mode``) for a weight update:
        retracted requests resume from their partial tokens, in-place ones keep their KV cache; the
        tokens after carry the new version either way. A colocated engine is already paused here."""
        tags = getattr(self.client, "tags_versions", False)  # a client keeping versions sees every update
        if self.config.rollout.placement == "colocated" or (self.scheduler is None and not tags):
            yield
            return
        await self.client.pause(self.config.rollout.pause_mode)
        try:
            yield
        finally:
            await self.client.resume()

    def end_step(self, groups: list[Group], train: dict[str, float], sync: dict[str, float]) -> None:
        self.step += 1
        row = {"step": self.step, "version": self.weight_version}
        row.update(group_metrics(groups))
        row.update(self.scheduler.metrics())
        row.update(self.buffer.metrics(self.weight_version))
        row.update(train)
        row.update(sync)
        row["groups/trained"] = float(len(groups))
        row["time/trainer_wait_s"] = self.timer["wait"]
        row.update(self.engine_metrics())
        row["seconds"] = time.perf_counter() - self.timer["start"]
        self.log.write_step(row)
        self.log.write_samples(self.step, groups, self.tokenizer)  # rollouts/step-N.jsonl (noria inspect)

    async def evaluate(self, when: str) -> None:
        """Held-out accuracy if due, where ``eval.mode`` says (``noria.eval.modes.Evaluations``); a
        failure is logged as skipped, not raised (except a failure of the rollout engine in shared mode)."""
        await self.evals.evaluate(when)

    def save(self, when: str) -> None:
        every = self.config.train.save_every
        if when == "end":
            with phase(f"exporting the final model to {self.folder / 'final'}"):
                self.backend.export_hf(self.folder / "final")
        if every and (self.step % every == 0 or when == "end") and self.step > 0:
            from noria.train import checkpoint_dir

            target = checkpoint_dir(self.folder, self.step)
            if not target.exists():
                with phase(f"saving checkpoint {target}"):
                    if self.critic is not None:  # first: the policy's checkpoint commits the step
                        self.critic.save(critic_checkpoint(target))
                    self.backend.save(target, extra=self.checkpoint_extra())

    def checkpoint_extra(self) -> dict[str, Any]:
        """The run's position; groups still generating are not saved: their prompts go back to the source."""
        next_group_id, unfinished = self.scheduler.resume_point() if self.scheduler else (self.next_group_id, [])
        data = self.source.state_dict()
        data["returned"] = [prompt_to_dict(p) for p in unfinished] + data["returned"]
        return {
            "rl_step": self.step,
            "next_group_id": next_group_id,
            "trained_groups": self.trained_groups,
            "weight_version": self.weight_version,
            "data": data,
            "buffer": self.buffer.state_dict(),
        }

    def restore(self) -> None:
        from noria.run_folder import keep_metrics_through
        from noria.train import latest_checkpoint

        ckpt = latest_checkpoint(self.folder)
        if ckpt is not None:
            extra = self.backend.load(ckpt)
            if self.critic is not None:
                self.critic.load(critic_checkpoint(ckpt))
            self.step = int(extra["rl_step"])
            self.next_group_id = int(extra["next_group_id"])
            self.trained_groups = int(extra.get("trained_groups", self.step * self.config.rollout.prompts_per_step))
            # "version": the key of checkpoints written before the weight version had one owner.
            self.weight_version = int(extra["weight_version"] if "weight_version" in extra else extra["version"])
            self.source.load_state_dict(extra["data"])
            self.buffer.load_state_dict(extra["buffer"])
        for name in ("metrics.jsonl", "eval.jsonl"):
            keep_metrics_through(self.folder / name, self.step)
        self.evals.last_step = self.step if self.step > 0 else None
        print(f"noria train: resuming {self.folder} at step {self.step} ({ckpt or 'no checkpoint yet'})", file=sys.stderr)

    def engine_metrics(self) -> dict[str, float]:
        if self.local_engine is None:
            return {}
        m = self.local_engine.metrics()
        return {"engine/prefix_hit_rate": float(m["prefix_hit_rate"]), "engine/retractions": float(m["retractions"])}

    def close(self) -> None:
        self.evals.close()  # evaluation engines stopped, evaluations in flight cancelled
        if self.log is not None:
            self.log.close()
        if self.sync is not None:
            with contextlib.suppress(Exception):
                self.sync.close()
        if self.local_engine is not None:
            self.local_engine.shutdown(drain_timeout_s=1.0)
        if self.engine_process is not None and self.config.rollout.engine == "vllm":
            from noria.engine.vllm_server import stop_vllm_server

            stop_vllm_server(self.engine_process)  # its whole process group (vLLM's engine core too)
        elif self.engine_process is not None:
            stop_server(self.engine_process)
        if self.teacher_process is not None:
            stop_server(self.teacher_process)


# ---------------------------------------------------------------------------------------- helpers


def context_limit(config: RunConfig) -> int | None:
    """The engine's context in tokens (prompt + output): ``engine.max_context``, else the model's positions."""
    from noria.models.catalog import model_path
    from noria.models.checkpoint import read_config

    return config.engine.max_context or read_config(model_path(config.model.path)).get("max_position_embeddings")


def check_supported(config: RunConfig) -> None:
    """What this launcher cannot run, on top of the config's own checks (run once, here, for a config
    built in code; a loaded one was checked when loaded)."""
    ensure_valid(config)
    if config.train.algorithm != "rl":
        raise NoriaError("run_rl needs train.algorithm: rl")
    if config.train.world_size > 1:
        raise NoriaError("train.world_size > 1 for RL runs on noria.launch.scaled.ScaledJob (run_rl picks it), not LocalJob")


def check_teacher_tokenizer(config: RunConfig, tokenizer: Any) -> None:
    """On-policy distillation with a teacher model (``opd.teacher``): its tokenizer must be the
    student's (``noria.distill.teacher.check_tokenizers``); servers by URL are checked when reached."""
    if config.train.loss.opd_coef <= 0 or not config.opd.teacher:
        return
    from noria.distill.teacher import check_tokenizers
    from noria.models import load_tokenizer

    check_tokenizers(tokenizer, load_tokenizer(config.opd.teacher), config.opd.teacher, config.model.path)


def granularity(rollout: Any) -> str:
    """``rollout.granularity`` resolved: auto is sample-level under asynchronous RL, group-level otherwise."""
    if rollout.granularity != "auto":
        return rollout.granularity
    return "sample" if rollout.max_staleness > 0 else "group"


def rollout_plugin(rollout: Any) -> dict[str, Any]:
    """How the scheduler produces a group: per trajectory with a generate function (the default, or
    ``rollout.generate_fn``), or a whole group at a time through a rollout or agent function."""
    if getattr(rollout, "rollout_fn", "") or getattr(rollout, "agent_fn", ""):
        return {"rollout_group": run_rollout}
    if getattr(rollout, "generate_fn", ""):
        from noria.plugins import load_plugin

        return {"generate": load_plugin(rollout.generate_fn, "rollout.generate_fn")}
    return {"generate": generate_one}


def critic_checkpoint(policy_checkpoint: Path) -> Path:
    """Where the critic of a policy checkpoint lives (``step-N.critic``, committed before ``step-N``)."""
    return policy_checkpoint.with_name(policy_checkpoint.name + ".critic")


def backend_options(config: RunConfig) -> dict[str, Any]:
    """Keyword options of the backend that depend on other sections (deterministic numerics)."""
    temperature = config.rollout.temperature if config.rollout.temperature > 0 else 1.0
    return {"deterministic": config.engine.deterministic, "temperature": temperature}


def build_weight_sync(config: RunConfig, target: Any, folder: Path) -> Any:
    import dataclasses

    from noria.sync import build_sync

    cfg = config.sync
    from noria.launch.external import sync_transport

    if cfg.transport == "auto" and sync_transport(config) == "disk":
        cfg = dataclasses.replace(cfg, transport="disk")  # an external server or vLLM loads a folder
    if cfg.broadcast_backend == "auto" and same_cuda_device(config.train.device, engine_device(config)):
        cfg = dataclasses.replace(cfg, broadcast_backend="gloo")  # NCCL: one rank per GPU
    from noria.models.catalog import model_path

    return build_sync(cfg, [target], run_dir=folder, source=model_path(config.model.path), device=config.train.device)


def engine_device(config: RunConfig) -> str:
    """The device of the ``noria serve`` engine the run starts: ``rollout.engine_device`` or ``model.device``."""
    return config.rollout.engine_device or config.model.device


def same_cuda_device(a: str, b: str) -> bool:
    """Whether two device strings name the same CUDA device (``cuda`` is ``cuda:0``: no process here
    sets another current device before the trainer and the engine load)."""
    import torch

    da, db = torch.device(a), torch.device(b)
    return da.type == db.type == "cuda" and (da.index or 0) == (db.index or 0)


def check_served_versions(groups: list[Group], pushed: int) -> None:
    """EngineFailure when a token was generated by weights newer than the last version this run pushed:
    something else updated the engine (its API key leaked, or another trainer shares it)."""
    served = max((v for g in groups for s in g.samples for v in s.weight_versions), default=0)
    if served > pushed:
        group = next(g for g in groups if any(v == served for s in g.samples for v in s.weight_versions))
        raise EngineFailure(
            f"group {group.group_id} was generated with weight version {served}, but this run has pushed versions up to "
            f"{pushed} only: the engine took weights from elsewhere; stopping rather than train on them"
        )


def group_metrics(groups: list[Group]) -> dict[str, float]:
    """What the trained groups hold: rewards, lengths, statuses, weight versions."""
    samples = [s for g in groups for s in g.samples]
    rewards = [s.reward for s in samples if s.reward is not None]
    lengths = [len(s.response_ids) for s in samples]
    solved = [g for g in groups if any((s.reward or 0) > 0 for s in g.samples)]
    uniform = [g for g in groups if len({s.reward for s in g.samples}) == 1]
    mixed = [g for g in groups if len({v for s in g.samples for v, m in zip(s.weight_versions, s.loss_mask) if m}) > 1]
    return {
        "rollout/reward_mean": mean(rewards),
        "rollout/response_len_mean": mean(lengths),
        "rollout/trained_tokens": float(sum(lengths)),
        "rollout/truncated_frac": mean([s.status is Status.TRUNCATED for s in samples]),
        "rollout/aborted": float(sum(s.status is Status.ABORTED for s in samples)),
        "rollout/groups_solved_frac": len(solved) / max(len(groups), 1),
        "rollout/groups_zero_variance_frac": len(uniform) / max(len(groups), 1),
        "rollout/groups_mixed_versions_frac": len(mixed) / max(len(groups), 1),
    }


def eval_sampling(config: RunConfig) -> Any:
    import dataclasses

    e = config.eval
    return dataclasses.replace(config.rollout, max_new_tokens=e.max_new_tokens, temperature=e.temperature, top_p=e.top_p, top_k=-1, min_p=0.0)


# ------------------------------------------------------------------------------ engine server process


def start_server(
    path: Path, config: RunConfig, folder: Path, device: str | None = None, log_name: str = "engine.log",
    api_key: str | None = None, host: str = "127.0.0.1", threads: int | None = None,
) -> tuple[subprocess.Popen, str, str]:
    """``noria serve`` of ``path`` on a free loopback port as a child process that dies with this one,
    behind a per-run API key (``api_key``, else a new one; in its environment, not on its command
    line: a fleet shares one with its router), bound to ``host`` (loopback unless a launcher gives
    the node's address for other machines to reach), on ``device`` (default
    ``engine_device``), logging to ``folder / log_name``, on ``threads`` torch threads
    (``OMP_NUM_THREADS``; None, or that variable set here: as this process); waits until it answers
    /health. Returns (process, url, key)."""
    from noria.net import free_port

    port = free_port(host)
    cmd = [sys.executable, "-m", "noria", "serve", "--model", str(path), "--host", host, "--port", str(port)]
    cmd += ["--dtype", config.model.dtype, "--device", device or engine_device(config), "--weight-version", "0"]
    for f in fields(config.engine):
        value = getattr(config.engine, f.name)
        if value is not None:
            cmd += [f"--engine.{f.name}", json.dumps(value) if not isinstance(value, str) else value]
    folder.mkdir(parents=True, exist_ok=True)
    log = open(folder / log_name, "ab")
    key = api_key or secrets.token_urlsafe(32)
    env = child_env(PYTHONUNBUFFERED="1", NORIA_API_KEY=key)
    if threads is not None and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent())
    url = f"http://{host}:{port}"
    wait_healthy(process, url, folder / log_name, api_key=key)
    return process, url, key


def wait_healthy(
    process: subprocess.Popen, url: str, log_path: Path, timeout_s: float = SERVE_READY_TIMEOUT_S, api_key: str | None = None
) -> None:
    """Wait until the ``noria serve`` child at ``url`` answers /health; EngineFailure (with the log's
    tail) if it exits first, or (after stopping it) if it is not healthy within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise EngineFailure(f"engine server (noria serve) exited with code {process.returncode} while starting:\n{tail}")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{url}/health", headers=headers), timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    stop_server(process)
    raise EngineFailure(f"engine server at {url} did not become healthy within {timeout_s:g} s (see {log_path})")


def stop_server(process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM (it drains), SIGKILL after ``timeout_s``; a stopped (SIGSTOP) engine is continued so it can act."""
    if process.poll() is None:
        process.terminate()
        process.send_signal(signal.SIGCONT)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
