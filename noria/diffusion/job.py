"""``noria train`` of an image model: the RL job on the one loop, and flow-matching SFT.

RL (``train.algorithm: rl``): ``DiffusionJob`` is the base RL job (``noria.launch.job.LocalJob``,
a ``noria.loop.Job``) with the image parts swapped in through its hooks, so ``noria.loop.rl_loop``, the
rollout scheduler, the group buffer (staleness, filters, drops), weight sync, checkpoints and
resume, metrics.jsonl, rollouts/ and the report are the text run's own:

- data: class-condition prompts of ``data.task: digits`` (``noria.diffusion.data``), prompt ids
  = [label]; evaluation: each class once, ``eval.n_samples`` images each, on salted seeds;
- engine: ``DiffusionEngine`` in process (colocated) or ``noria serve`` of the DiT folder
  (disaggregated, ``DiffusionHttpClient``); the scheduler's generate function samples the SDE
  (``noria.diffusion.rollout``);
- trainer: ``DiffusionTrainer``; the step (``diffusion_rl_step``) takes the trainable samples,
  group advantages from the algorithms registry (``train.loss.advantage``, clipped to
  ``diffusion.adv_clip``) and runs the objective (``diffusion.objective``);
- evaluation: ODE images (``diffusion.eval_steps``) scored by ``diffusion.eval_reward`` (the
  held-out accuracy) and by the run's reward (``reward_mean``); a grid of the images goes to
  ``RUN_DIR/eval/step-N.png``.

SFT (``train.algorithm: sft``): ``run_sft`` trains the DiT by flow matching on the digits' train
split; a model folder holding only ``config.json`` starts from scratch (seeded). The run folder is
the text SFT's (metrics.jsonl rows with ``tokens`` = latent patches, checkpoints with the data
cursor, ``--resume``), and ``final/`` is a diffusers folder.

Not guaranteed: several trainer processes; LoRA adapter-only sync to a disaggregated engine
(``noria serve`` loads no adapters: use ``train.lora.sync: merged`` there).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from noria.config import RunConfig, save_config
from noria.errors import NoriaError
from noria.launch.job import LocalJob, steps_of
from noria.types import Group, Prompt


def train_diffusion(config: RunConfig, run_dir: str | None = None, resume: str | None = None, progress: bool | None = None) -> Path:
    """``noria train`` of a config with a ``diffusion`` section."""
    if config.train.algorithm == "sft":
        return run_sft(config, run_dir, resume, progress)
    from noria.launch.rl import run_rl

    return run_rl(config, run_dir, resume, progress, job_class=DiffusionJob)


class DiffusionJob(LocalJob):
    """The image RL job; see the module docstring."""

    def load_data(self) -> None:
        from noria.data import PromptSource
        from noria.diffusion.data import condition_prompts
        from noria.rewards.registry import prepared_reward

        cfg = self.config
        prepared_reward(self.reward.name, self.reward.kwargs)  # a bad import path fails here, before any model loads
        if cfg.diffusion.eval_reward:
            prepared_reward(cfg.diffusion.eval_reward, cfg.diffusion.eval_reward_kwargs)
        self.tokenizer = None
        train = condition_prompts("train", cfg.data.task_args)
        self.prompt_ids = {p.index: [int(p.label)] for p in train}
        self.source = PromptSource.from_config(train, cfg.data)
        self.dropped_prompts = 0
        test = condition_prompts("test", cfg.data.task_args)[: cfg.eval.limit]
        self.test_prompts: list[tuple[Prompt, list[int]]] = [(p, [int(p.label)]) for p in test] if cfg.eval.every > 0 else []
        self.total_steps = steps_of(cfg, len(train), "condition prompts")

    def build_evals(self) -> Any:
        cfg = self.config
        if cfg.eval.every > 0 and cfg.eval.mode != "shared":
            raise NoriaError(f"eval.mode {cfg.eval.mode}: image runs (model.family diffusion) evaluate in shared mode only")
        return super().build_evals()

    def build_trainer(self) -> tuple[Any, Any]:
        """The DiT's trainer (no critic)."""
        from noria.diffusion.trainer import DiffusionTrainer

        cfg = self.config
        trainer = DiffusionTrainer(cfg.train, cfg.diffusion, seed=cfg.seed, deterministic=cfg.engine.deterministic)
        trainer.init(Path(cfg.model.path), total_steps=self.total_steps * cfg.train.steps_per_rollout)
        return trainer, None

    def start_engine(self, path: Path) -> tuple[Any, Any]:
        from noria.rollout import LocalEngineClient

        cfg = self.config
        timeout = cfg.rollout.engine_timeout_s
        if cfg.rollout.placement == "colocated":
            from noria.diffusion.engine import DiffusionEngine

            lora = cfg.train.lora if cfg.train.lora.enabled else None
            self.local_engine = DiffusionEngine.from_path(path, cfg.engine, cfg.model.dtype, cfg.model.device, lora=lora)
            return LocalEngineClient(self.local_engine, timeout), self.local_engine
        from noria.diffusion.server import DiffusionHttpClient
        from noria.sync.targets import HttpEngine

        if cfg.train.lora.enabled and cfg.train.lora.sync == "adapter":
            raise NoriaError("train.lora.sync: adapter needs rollout.placement: colocated for a diffusion run "
                             "(noria serve of a DiT loads no adapters); use train.lora.sync: merged")  # fmt: skip
        url, key = cfg.rollout.engine_url, None
        if url is None:
            self.engine_process, url, key = self.start_child(path, "engine.log")
        client = DiffusionHttpClient(url, api_key=key, timeout_s=timeout, process=self.engine_process)
        return client, HttpEngine(url, api_key=key)

    def rollout_plugin(self) -> dict[str, Any]:
        from noria.diffusion.rollout import generate_fn

        d = self.config.diffusion
        return {"generate": generate_fn(d.steps, d.noise_level, d.shift)}

    def train(self, groups: list[Group]) -> dict[str, float]:
        return diffusion_rl_step(self.backend, groups, self.config, self.weight_version)

    def engine_metrics(self) -> dict[str, float]:
        return {}

    async def evaluate(self, when: str) -> None:
        """Held-out class accuracy of ODE images on unseen seeds (see the module docstring); a
        failure is logged as skipped, except an engine failure."""
        from noria.diffusion.evaluate import evaluate_images
        from noria.rollout import EngineFailure

        if not self.evals.due(when):  # image evaluation runs in shared mode only (start_parts refuses the others)
            return
        self.evals.last_step = self.step
        head = {"step": self.step, "version": self.weight_version}
        try:
            row, samples = await evaluate_images(self.client, self.config, self.test_prompts, self.folder / "eval" / f"step-{self.step:06d}.png")
        except EngineFailure:
            raise
        except Exception as e:  # noqa: BLE001 -- an evaluation failure never stops training
            self.log.write_eval({**head, "skipped": f"{type(e).__name__}: {e}"})
            return
        self.log.write_eval({**head, **row}, samples)


def diffusion_rl_step(trainer: Any, groups: list[Group], config: RunConfig, weight_version: int) -> dict[str, float]:
    """``train.steps_per_rollout`` optimizer steps on the groups' trainable images: group advantages
    (``train.loss.advantage``, failed samples excluded first) clipped to ``diffusion.adv_clip``."""
    from noria.train.algorithms import compute_advantages
    from noria.diffusion.objectives import clip_advantages
    from noria.train.rl_step import average, trainable

    t0 = time.perf_counter()
    kept = [g for g in (trainable(g) for g in groups) if g]
    samples = [s for g in kept for s in g]
    if not samples:
        return {"time/train_s": time.perf_counter() - t0, "train/skipped_no_samples": 1.0}
    advantages = compute_advantages(config.train.loss, [[s.reward for s in g] for g in kept])
    flat = clip_advantages([a for per_group in advantages for a in per_group], config.diffusion.adv_clip)
    out = average(trainer.rl_steps(samples, flat, config.train.steps_per_rollout))
    out["optimizer_step"] = out.pop("step", float(trainer.optimizer_steps))
    out["train/samples"] = float(len(samples))
    lags = [weight_version - v for s in samples for v in s.weight_versions]
    out["train/token_staleness_mean"] = sum(lags) / len(lags)
    out["train/token_staleness_max"] = float(max(lags))
    out["time/train_s"] = time.perf_counter() - t0
    return out


# ----------------------------------------------------------------------------------------- SFT


def run_sft(config: RunConfig, run_dir: str | None, resume: str | None, progress: bool | None) -> Path:
    """Flow-matching SFT of the DiT on the digits' train split (see the module docstring)."""
    from noria.data import PromptSource
    from noria.diffusion.trainer import DiffusionTrainer
    from noria.run_folder import check_run_folder, make_run_folder, resolve_run_dir
    from noria.train.checkpoint import checkpoint_dir
    from noria.launch.sft import StepLog, restore, step_row, total_steps

    latents, labels, records = sft_data(config)
    folder = resolve_run_dir(config, run_dir, resume)
    check_run_folder(folder, config, resume is not None)
    steps = total_steps(config, len(records))
    trainer = DiffusionTrainer(config.train, config.diffusion, seed=config.seed)
    trainer.init(config.model.path, total_steps=steps, allow_new=True)
    source = PromptSource.from_config(records, config.data)
    if resume is not None:
        restore(trainer, source, folder)
    config.run_dir = str(folder)
    make_run_folder(folder)
    save_config(config, folder / "config.yaml")
    log = StepLog(folder / "metrics.jsonl", True, steps, trainer.optimizer_steps, progress)
    while trainer.optimizer_steps < steps and not source.exhausted:
        idx = torch.tensor([r.index for r in source.next_batch(config.train.global_batch)])
        log.write(step_row(trainer.sft_step(latents[idx], labels[idx]), source.epoch))
        if config.train.save_every and trainer.optimizer_steps % config.train.save_every == 0:
            trainer.save(checkpoint_dir(folder, trainer.optimizer_steps), extra={"data": source.state_dict()})
    log.close()
    if trainer.optimizer_steps == 0:
        raise NoriaError(f"SFT trained nothing: {len(records)} images, data.epochs={config.data.epochs}")
    trainer.export_hf(folder / "final")
    print(f"noria train: {trainer.optimizer_steps} steps; model in {folder / 'final'}", file=sys.stderr)
    return folder


def sft_data(config: RunConfig) -> tuple[torch.Tensor, torch.Tensor, list[Prompt]]:
    """(latents [N, C, H, W], labels [N], one record per image for the data source) of the train split."""
    from noria.diffusion.data import digits_args, digits_split
    from noria.diffusion.model import from_image

    args = digits_args(config.data.task_args)
    images, labels = digits_split("train", args["n_test"])
    latents = torch.stack([from_image(i) for i in images])
    records = [Prompt(f"digit {int(c)}", int(c), {}, i, "task:digits/train") for i, c in enumerate(labels)]
    return latents, torch.as_tensor(labels), records
