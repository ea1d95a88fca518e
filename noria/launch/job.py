"""The base RL job: ``LocalJob``, a ``noria.loop.Job`` on one machine (one trainer process, one
engine), and the named hooks through which every other job kind extends it.

Hooks, called by ``start_parts`` in this order; a job kind overrides the ones it changes and copies
none of the rest: ``build_evals`` (the evaluator of ``eval.mode``), ``build_engine`` (the client
rollout uses and the weight-sync target), ``build_teacher`` (on-policy distillation's teacher
engines), ``build_trainer`` (backend and critic), ``build_sync``. Then ``restore`` (resuming) and
``open_log``. Extended by ``noria.launch.scaled.ScaledJob`` (an engine fleet and trainer ranks),
``noria.launch.ray.RayJob`` (the same as Ray actors) and ``noria.diffusion.job.DiffusionJob`` (an
image model); ``noria.launch.rl.run_rl`` picks the class.

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

Weight updates: a disaggregated engine is paused around each push (``rollout.pause_mode``: retract or in place);
a colocated one is already paused, its KV memory released, for the trainer's turn. The ``broadcast`` transport's
group (``sync.broadcast_backend: auto``) is NCCL when the trainer is on a GPU and the engine on another one,
gloo otherwise (both on one GPU: NCCL refuses two ranks on one device, so the CUDA weights go through host
memory).

Child processes (``noria.process.Child``, through ``noria.engine.child``) get this process's environment with
NVLink multicast off; the ``noria serve`` child is started with a per-run API key (in its environment, never on
its command line) that every request and weight push carries, and dies with this process; a group generated with
a weight version this run never pushed stops the run (``check_served_versions``). A run that can train nothing
stops with an error naming why (``rollout.buffer.max_consecutive_drops``, ``DropStreak``).

Order of checks: the config is validated when loaded; prompts, reward and run folder are checked here before any
model loads, so a bad input costs seconds, not a model load. A build that fails closes what it had started
(engines, trainer ranks, Ray placement groups) before it raises.

Resume (``--resume RUN_DIR``, ``noria.launch.continuation.restore_rl``): the last committed checkpoint (a
finished run leaves one: ``train.save_final_state``) restores weights, AdamW, RNG, the data cursor, the groups
that were generating (continued from their recorded tokens, or their prompts put back first:
``rollout.resume_in_flight``), the buffer's waiting groups, the step, the group counter, the count of trained
groups and the weight version; the engine, started from the base model, receives the checkpoint's weights
under that version before the first rollout, and what was recorded after the checkpoint is moved to
``superseded/`` so the resumed run repeats exactly the same steps.

Not guaranteed: a colocated engine shares this process's CPU threads with the trainer (they never run at the
same time in synchronous RL)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from noria.config import RunConfig, save_config
from noria.console import phase
from noria.engine.child import engine_device
from noria.errors import NoriaError
from noria.eval.modes import Evaluations
from noria.launch.engine_figures import kv_usage, local_engine_figures
from noria.launch.parts import (
    backend_options,
    build_weight_sync,
    check_served_versions,
    check_supported,
    check_teacher_tokenizer,
    context_limit,
    critic_checkpoint, drafter_checkpoint,
)
from noria.metrics import RunLog, group_metrics
from noria.process import Child, signals_cancel_task
from noria.process.usage import memory_metrics
from noria.rewards.model import start_judge
from noria.rollout import HttpEngineClient, LocalEngineClient, RolloutContext
from noria.run_folder import IMAGES, make_run_folder, save_images
from noria.rollout.buffer import DropStreak, build_buffer, resolve_filters
from noria.rollout.generate import granularity, rollout_plugin
from noria.rollout.in_flight import LiveRequests, in_flight_policy, plan_resume
from noria.rollout.scheduler import RolloutScheduler
from noria.train.offload import offload_for
from noria.train.rl_step import on_device, rl_step
from noria.types import Group, Prompt


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
        try:
            with phase("reading the prompts and the tokenizer"):
                job.load_data()  # prompts and reward are checked before any model loads
            job.start_parts(resume is not None)
        except BaseException:
            with contextlib.suppress(Exception):  # what started before the failure: engines, ranks, Ray pools
                job.close()
            raise
        return job

    @staticmethod
    def check_supported(config: RunConfig) -> None:
        """What this job kind cannot run (``NoriaError``), before anything is read or started."""
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
        self.children: list[Child] = []
        """Processes this job started (its engine server, a teacher's): stopped by ``close``."""
        self.engine_process: Child | None = None
        """The rollout engine's process, when this job started one (``noria serve`` or vLLM)."""
        self.local_engine: Any = None
        self.engine_seen: dict[str, float] = {}
        """The in-process engine's running totals at the last step's line (``local_engine_figures``)."""
        self.engine_key: str | None = None
        """The API key of the ``noria serve`` child this job started (its ``/get_load`` feeds ``engine_metrics``)."""
        self.client: Any = None
        self.processor: Any = None
        """A vision-language model's processor (``load_data``): prompts with images, their pixels."""
        self.pixels: Any = None
        self.image_refs: list[str] = []
        self.backend: Any = None
        self.offload: Any = None
        """``train.offload_optimizer``: the optimizer state's mover (``noria.train.offload``), or None."""
        self.critic: Any = None
        self.sync: Any = None
        self.log: RunLog | None = None
        self.teacher: Any = None
        """On-policy distillation with teacher engines (``noria.distill.teacher.EngineTeacher``), or None."""
        self.evals = Evaluations(self)
        """The evaluator (``noria.eval.modes.Evaluations``): shared mode until ``start_parts`` builds the configured one."""
        self.timer: dict[str, float] = {}
        self.in_flight_record: dict[str, Any] | None = None  # the resumed checkpoint's (noria.rollout.in_flight)
        self.resume_metrics: dict[str, float] = {}  # resume/... figures for the first step's line after a resume
        self.start_event: dict[str, Any] = {}  # what a resume did, for events.jsonl (noria.launch.continuation)

    def load_data(self) -> None:
        from noria.data import PromptSource, drop_long, load_prompts, render_prompts
        from noria.data.chat import check_fit
        from noria.data.curriculum import Curriculum
        from noria.data.vision_chat import load_processor
        from noria.train.images import SamplePixels
        from noria.models import load_tokenizer
        from noria.models.catalog import model_path
        from noria.rewards.registry import prepared_reward

        cfg = self.config
        prepared_reward(self.reward.name, self.reward.kwargs)  # an unknown reward or a bad import path fails here (PluginError)
        self.tokenizer = load_tokenizer(model_path(cfg.model.path))
        self.processor = load_processor(model_path(cfg.model.path))  # a vision-language model's: prompts with images
        renderer = self.processor or self.tokenizer
        self.pixels = SamplePixels(model_path(cfg.model.path), self.folder / IMAGES)  # their pixels for the trainer
        train = render_prompts(load_prompts(cfg.data, "train"), renderer, cfg.data.chat_template, cfg.data.system_prompt)
        kept, dropped = drop_long(train, cfg.data.max_prompt_tokens)
        if not kept:
            raise NoriaError(f"no training prompts left ({len(train)} loaded, {dropped} over data.max_prompt_tokens)")
        check_fit(kept, context_limit(cfg), cfg.data.max_prompt_tokens)
        check_teacher_tokenizer(cfg, self.tokenizer)  # before any model loads
        self.prompt_ids = {r.prompt.index: r.ids for r in kept}
        self.image_refs = [ref for r in kept for ref in r.images]  # its prompts' images (test prompts' added below)
        self.source = PromptSource.from_config([r.prompt for r in kept], cfg.data)
        if cfg.data.curriculum.enabled:  # difficulty pools over the same cursor (noria.data.curriculum)
            self.source = Curriculum.from_config(self.source, [r.prompt for r in kept], cfg.data)
        self.dropped_prompts = dropped
        self.test_prompts: list[tuple[Prompt, list[int]]] = []
        if cfg.eval.every > 0:
            test = load_prompts(cfg.data, "test")[: cfg.eval.limit]
            rendered = render_prompts(test, renderer, cfg.data.chat_template, cfg.data.system_prompt)
            fit = drop_long(rendered, cfg.data.max_prompt_tokens)[0]
            check_fit(fit, context_limit(cfg), cfg.data.max_prompt_tokens)
            self.test_prompts = [(r.prompt, r.ids) for r in fit]
            self.image_refs += [ref for r in fit for ref in r.images]
        self.total_steps = steps_of(cfg, len(kept), "training prompts")

    def start_parts(self, resume: bool) -> None:
        """Build every part through the hooks below, in this order (a job kind overrides the hooks it
        changes and copies none of this), restore the checkpoint when resuming, open the run's log."""
        make_run_folder(self.folder)
        save_images(self.folder, self.image_refs)  # a vision-language run's images, each once (trainer ranks in other processes read them)
        self.evals = self.build_evals()  # eval.mode fleet: its engines; checkpoint: its backend
        self.client, target = self.build_engine()
        self.teacher = self.build_teacher()
        self.children += start_judge(self.config, self.folder, self.client, self.tokenizer)  # reward.model.engine: the judge's noria serve (or shared)
        self.backend, self.critic = self.build_trainer()
        self.sync = self.build_sync(target)
        if resume:
            self.restore()
        self.open_log()

    # ------------------------------------------------------------------------------------ hooks

    def build_evals(self) -> Evaluations:
        """The evaluator of ``eval.mode`` (hook)."""
        return Evaluations.build(self)

    def build_engine(self) -> tuple[Any, Any]:
        """Hook: (the engine client rollout uses, the target weight sync pushes to). Here: the built-in
        engine in this process (colocated), a ``noria serve`` child, vLLM, or the server at ``rollout.engine_url``."""
        from noria.models.catalog import model_path

        cfg = self.config
        path = model_path(cfg.model.path)
        with phase(f"starting the rollout engine ({cfg.rollout.placement}) with {path} ({cfg.model.dtype}, {cfg.model.device})"):
            return self.start_engine(path)

    def build_trainer(self) -> tuple[Any, Any]:
        """Hook: (the trainer backend, the PPO critic or None), loaded from ``model.path``."""
        from noria.models.catalog import model_path
        from noria.models.hf import disable_dropout
        from noria.train import build_backend

        cfg = self.config
        path = model_path(cfg.model.path)
        steps = self.total_steps * cfg.train.steps_per_rollout
        with phase(f"loading the trainer's copy of the model ({cfg.train.param_dtype}, {cfg.train.device})"):
            backend = build_backend(cfg.train, model_impl=cfg.model.impl, seed=cfg.seed, **backend_options(cfg))
            backend.init(path, total_steps=steps)
            disable_dropout(backend.lm)  # transformers' models (GPT-2...): train what the engine sampled from
        self.offload = offload_for(cfg, backend)
        critic = None
        if cfg.train.loss.advantage == "gae":  # PPO: a value model gives per-token advantages
            from noria.train.critic import CriticBackend

            critic = CriticBackend(cfg.train, seed=cfg.seed)
            critic.init(path, total_steps=steps)
        return backend, critic

    def build_sync(self, target: Any) -> Any:
        """Hook: the weight sync from the trainer to ``target`` (``build_engine``'s)."""
        return build_weight_sync(self.config, target, self.folder)

    def open_log(self) -> None:
        """The resolved config and the run log in the run folder."""
        cfg = self.config
        cfg.run_dir = str(self.folder)
        save_config(cfg, self.folder / "config.yaml")
        self.log = RunLog(self.folder, self.total_steps, self.step, self.progress, config=cfg, event=self.start_event)

    def start_engine(self, path: Path) -> tuple[Any, Any]:
        """(the client rollout uses, the target weight sync pushes to)."""
        from noria.engine import in_process_engine, serves_natively
        from noria.launch.external import start_vllm_engine
        from noria.sync.targets import HttpEngine

        cfg = self.config
        timeout = cfg.rollout.engine_timeout_s
        if cfg.rollout.placement == "colocated":
            m = cfg.model
            self.local_engine = in_process_engine(path, cfg.engine, m.impl, m.dtype, m.device, cfg.seed)
            return LocalEngineClient(self.local_engine, timeout, folder=path), self.local_engine
        if cfg.rollout.engine == "vllm":  # a vLLM OpenAI server (noria.launch.external)
            self.engine_process, client, target = start_vllm_engine(path, cfg, self.folder)
            self.children += [self.engine_process] if self.engine_process is not None else []
            return client, target
        if cfg.rollout.engine_url is None and not serves_natively(path, cfg.model.impl):
            raise NoriaError(
                f"{cfg.model.path}: the generic transformers engine (model.impl: hf, or a family with no native model) "
                "runs in process only: set rollout.placement: colocated"
            )

        url, key = cfg.rollout.engine_url, None
        if url is None:
            self.engine_process, url, key = self.start_child(path, "engine.log")
            self.engine_key = key
        from noria.launch.external import check_engine

        check_engine(cfg, url, key)  # a config needing what the engine lacks stops here, before the trainer loads
        client = HttpEngineClient(url, api_key=key, timeout_s=timeout, process=self.engine_process)
        return client, HttpEngine(url, api_key=key)

    def start_child(self, path: Path, log_name: str, device: str | None = None) -> tuple[Child, str, str]:
        """A ``noria serve`` child of ``path`` (``noria.engine.child``), stopped by ``close``: (child, url, key)."""
        from noria.engine.child import start_engine_server

        child, url, key = start_engine_server(path, self.config, self.folder, device, log_name)
        self.children.append(child)
        return child, url, key

    def build_teacher(self) -> Any:
        """Hook: ``opd.placement: engine``: the teacher engines (a ``noria serve`` of ``opd.teacher`` the
        run starts, or the servers at ``opd.teacher_url`` / ``opd.teachers``, tokenizers checked); else None."""
        from noria.distill.teacher import EngineTeacher, check_tokenizers, teacher_tokenizer
        from noria.models.catalog import model_path

        cfg, opd = self.config, self.config.opd
        if cfg.train.loss.opd_coef <= 0 or opd.placement != "engine":
            return None
        urls: dict[str | None, str] = dict(opd.teachers) or ({None: opd.teacher_url} if opd.teacher_url else {})
        keys: dict[str | None, str] = {}
        for value, url in urls.items():
            tokenizer, path = teacher_tokenizer(url)
            check_tokenizers(self.tokenizer, tokenizer, f"{path} (at {url})", cfg.model.path)
        child = None
        if not urls:
            device = opd.teacher_device or engine_device(cfg)
            child, url, keys[None] = self.start_child(model_path(opd.teacher), "teacher.log", device)
            urls = {None: url}
        timeout = cfg.rollout.engine_timeout_s
        clients = {v: HttpEngineClient(u, api_key=keys.get(v), timeout_s=timeout, process=child) for v, u in urls.items()}
        return EngineTeacher(clients, opd.teacher_key, cfg.rollout.temperature, opd.top_k)

    # ------------------------------------------------------------------------------------ loop calls

    async def run(self, loop_fn: Any) -> None:
        with signals_cancel_task():  # SIGTERM and Ctrl-C stop the loop at an await
            if self.config.rollout.engine_url:  # an external engine a killed run may have left paused mid-push
                await self.client.resume()
            if self.step > 0 or self.weight_version > 0:  # resumed: the engine still serves the base model
                await self.sync_weights(advance=False)
            await loop_fn(self)
        self.log.close()
        print(f"noria train: {self.step} steps; model in {self.folder / 'final'}", file=sys.stderr)

    def resume_hint(self) -> str:
        from noria.train import latest_checkpoint

        ckpt = latest_checkpoint(self.folder)
        if ckpt is None:
            return f"no checkpoint was committed in {self.folder}: start it again there with noria train --resume {self.folder} " \
                "--restart (its records are moved aside, not deleted)"
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
        top = self.teacher.top_k if self.teacher else 0
        live = LiveRequests() if in_flight_policy(r, self.client)[0] == "continue" else None  # checkpoints stop requests with their tokens
        ctx = RolloutContext(self.client, self.tokenizer, r, seed=self.config.seed, top_logprobs=top, live=live, processor=self.processor)
        self.scheduler = RolloutScheduler(
            ctx, self.next_prompt, self.buffer, self.reward, n_samples=r.n_samples, groups_per_step=r.prompts_per_step,
            max_staleness=r.max_staleness, max_in_flight=r.max_in_flight or r.prompts_per_step * r.n_samples,
            granularity=granularity(r), next_group_id=self.next_group_id, version=lambda: self.weight_version,
            trained=self.trained_groups, observe=getattr(self.source, "observe", None), **self.rollout_plugin(),
        )  # fmt: skip
        if self.in_flight_record:  # resumed: the checkpoint's in-flight groups continued or retracted, said and counted
            plan = plan_resume(self.in_flight_record, self.weight_version, r)
            self.resume_metrics, self.in_flight_record = plan.apply(self.scheduler, self.source.return_prompt), None
            print(f"noria train: {plan.describe()}", file=sys.stderr)
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

    def hold_rollout(self, held: bool) -> None:
        """While held, the scheduler starts no group (``noria.eval.modes.EvalHost``); none runs before the rollout starts."""
        if self.scheduler is not None:
            self.scheduler.hold(held)

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
        lora = self.config.train.lora  # a full sync writes every weight again before the resume: the engine may free them
        await self.client.release_memory(weights=not (lora.enabled and lora.sync == "adapter"))
        if self.offload is not None:
            self.offload.reload()
        yield  # a stop raised here (a signal, a failed step) leaves the engine released: its weights may be
        # freed with no update since, and a resume would raise over the reason the run stops
        if self.offload is not None:  # before the engine takes its KV cache back
            self.offload.offload()
        await self.client.resume_memory()
        await self.client.resume()
        self.scheduler.hold(False)

    def train(self, groups: list[Group]) -> dict[str, float]:
        """``steps_per_rollout`` optimizer steps on the groups' trainable samples (``noria.train.rl_step``)."""
        cfg = self.config
        opd = cfg.opd if cfg.train.loss.opd_coef > 0 else None
        metrics = rl_step(self.backend, groups, cfg.train, self.weight_version, self.critic, cfg.rollout.routing_replay, opd, self.pixels)
        return metrics if self.offload is None else {**metrics, **self.offload.metrics()}

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
        if hasattr(self.source, "metrics"):  # curriculum/... (data.curriculum)
            row.update(self.source.metrics())
        row.update(train)
        row.update(sync)
        row["groups/trained"] = float(len(groups))
        row.update(self.resume_metrics)
        self.resume_metrics = {}
        row["time/trainer_wait_s"] = self.timer["wait"]
        row.update(self.engine_metrics())
        row.update(memory_metrics())
        row["seconds"] = time.perf_counter() - self.timer["start"]
        self.log.write_step(row)
        self.log.write_samples(self.step, groups, self.tokenizer)  # rollouts/step-N.jsonl (noria inspect)

    async def evaluate(self, when: str) -> None:
        """Held-out accuracy if due, where ``eval.mode`` says (``noria.eval.modes.Evaluations``); a
        failure is logged as skipped, not raised (except a failure of the rollout engine in shared mode)."""
        await self.evals.evaluate(when)

    async def save(self, when: str) -> None:
        """A checkpoint when due (``continuation.checkpoint_due``: at the end too, to extend the run); at the end, the final model."""
        from noria.launch.continuation import checkpoint_due

        if checkpoint_due(self.config.train, self.step, when):
            from noria.train import checkpoint_dir

            target = checkpoint_dir(self.folder, self.step)
            if not target.exists():
                async with self.scheduler.in_flight_stopped() if self.scheduler else contextlib.nullcontext() as in_flight:
                    with phase(f"saving checkpoint {target}"):
                        if self.critic is not None:  # first: the policy's checkpoint commits the step
                            self.critic.save(critic_checkpoint(target))
                        if hasattr(self.local_engine, "save_drafter"):  # the built-in engine's mlp drafter, as the critic
                            self.local_engine.save_drafter(drafter_checkpoint(target))
                        self.backend.save(target, extra=self.checkpoint_extra(in_flight))
        if when == "end":
            with phase(f"exporting the final model to {self.folder / 'final'}"):
                self.backend.export_hf(self.folder / "final")

    def checkpoint_extra(self, in_flight: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The run's position, read in one event-loop turn. ``in_flight``: the groups in flight, recorded
        with their tokens (``rollout.resume_in_flight``); without it their prompts go back to the source."""
        s = self.scheduler
        next_group_id, unfinished = (s.next_group_id, []) if in_flight is not None else s.resume_point() if s else (self.next_group_id, [])
        retracted = [] if in_flight is not None or s is None else sorted(s.pending)
        why = "" if in_flight is not None else in_flight_policy(self.config.rollout, self.client)[1] or "the rollout had stopped"
        data = self.source.state_dict(put_back=unfinished)  # their prompts first when resumed
        return {
            "rl_step": self.step,
            "next_group_id": next_group_id,
            "trained_groups": self.trained_groups,
            "weight_version": self.weight_version,
            "data": data,
            "buffer": self.buffer.state_dict(),
            "in_flight": {"groups": in_flight or [], "retracted": retracted, "reason": why},
        }

    def restore(self) -> None:
        """``--resume``: the run where its last committed checkpoint left it (``noria.launch.continuation``)."""
        from noria.launch.continuation import restore_rl

        restore_rl(self)

    def engine_metrics(self) -> dict[str, float]:
        """The rollout engine's figures of the step's line (``noria.launch.engine_figures``)."""
        if self.local_engine is None:
            return kv_usage([(self.client.base_url, self.engine_key)]) if self.engine_key else {}
        return local_engine_figures(self.local_engine.metrics(), self.engine_seen)

    def close(self) -> None:
        self.evals.close()  # evaluation engines stopped, evaluations in flight cancelled
        if self.log is not None:
            self.log.close()
        if self.sync is not None:
            with contextlib.suppress(Exception):
                self.sync.close()
        if self.local_engine is not None:
            self.local_engine.shutdown(drain_timeout_s=1.0)
        for child in reversed(self.children):  # a vLLM server: its whole process group (its engine core too)
            child.stop()


def steps_of(config: RunConfig, n_prompts: int, what: str) -> int:
    """Rollout steps of a run over ``n_prompts`` training prompts: ``data.epochs`` of them in steps of
    ``rollout.prompts_per_step``, capped by ``train.max_steps``; ``NoriaError`` when not one step fills."""
    per_epoch = n_prompts * config.data.epochs // config.rollout.prompts_per_step
    steps = min(per_epoch, config.train.max_steps) if config.train.max_steps else per_epoch
    if steps < 1:
        raise NoriaError(f"{n_prompts} {what} x {config.data.epochs} epochs do not fill one step of "
                         f"rollout.prompts_per_step={config.rollout.prompts_per_step}")  # fmt: skip
    return steps
