"""The ``diffusion`` config section: present in a run config, the run trains an image model.

A run whose config has a ``diffusion:`` mapping (even an empty one) generates images with the
flow-matching DiT of ``noria.diffusion`` instead of text; every other section keeps its meaning
where it applies (``model.path``/``dtype``/``device``, ``data.task: digits``, ``reward``,
``rollout.n_samples`` = images per condition, ``rollout.prompts_per_step`` = conditions per step,
placement, staleness and the buffer, ``engine.deterministic`` and ``engine.max_running_requests``,
``train.*``, ``sync.*``, ``eval.every``/``n_samples``/``seed``/``limit``, ``log.*``). Fields that
only mean something for text (``rollout.max_new_tokens``, ``temperature``, ...) are ignored.

Owner: ``noria.diffusion``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from noria.config.schema import ConfigError, option


@dataclass
class DiffusionConfig:
    """Image generation and training of a flow-matching DiT (``noria.diffusion``)."""

    steps: int = option(10, "Denoising steps T of a rollout image (each step is one trained 'token' of the trajectory).")
    noise_level: float = option(
        0.7, "Flow-GRPO's SDE noise level a: each rollout step is a Gaussian transition with std a*sqrt(s/(1-s))*sqrt(-dt); "
        "0 samples the ODE (no log-probabilities, diffusion_nft only)."
    )
    shift: float = option(1.0, "Timestep shift of the flow-matching schedule (diffusers' FlowMatchEulerDiscreteScheduler; SD3 uses 3.0).")
    train_steps: int | None = option(
        None, "Flow-GRPO: denoising steps of each trajectory trained on, a seeded random subset (Flow-GRPO's timestep "
        "fraction); null trains all steps."
    )
    eval_steps: int = option(20, "ODE steps of evaluation images (deterministic given the seed).")
    objective: str = option(
        "flow_grpo", "RL objective, a name of noria.diffusion.objectives (flow_grpo: clipped per-step likelihood "
        "ratios of the SDE; diffusion_nft: likelihood-free, on the forward process of the final images)."
    )
    adv_clip: float = option(5.0, "Advantages are clipped to [-adv_clip, adv_clip] (Flow-GRPO; DiffusionNFT maps them to [0, 1] by it).")
    nft_beta: float = option(1.0, "DiffusionNFT: strength beta of the implicit positive/negative policies.")
    nft_timesteps: int = option(4, "DiffusionNFT: noise levels drawn per image per optimizer step.")
    sft_sigmas: Literal["uniform", "logit_normal"] = option(
        "logit_normal", "Flow-matching SFT: distribution of the training noise level (logit_normal: SD3's, mean 0, std 1)."
    )
    eval_reward: str | None = option(
        None, "Reward whose mean over the evaluation images is the held-out accuracy (e.g. "
        "noria.diffusion.rewards:digit_correct); null uses reward.name."
    )
    eval_reward_kwargs: dict[str, Any] = option(factory=dict, help="Keyword arguments of eval_reward.")

    def validate(self) -> None:
        for key in ("steps", "eval_steps", "nft_timesteps"):
            if getattr(self, key) < 1:
                raise ConfigError(f"diffusion.{key} must be >= 1, got {getattr(self, key)}")
        if self.train_steps is not None and not 1 <= self.train_steps <= self.steps:
            raise ConfigError(f"diffusion.train_steps must be in [1, diffusion.steps={self.steps}] or null, got {self.train_steps}")
        if self.noise_level < 0 or self.shift <= 0 or self.adv_clip <= 0 or self.nft_beta <= 0:
            raise ConfigError("diffusion: noise_level must be >= 0; shift, adv_clip and nft_beta > 0")
        if self.eval_reward is not None and ":" not in self.eval_reward:
            raise ConfigError(f"diffusion.eval_reward must be an import path pkg.module:fn or null, got {self.eval_reward!r}")

    def validate_run(self, run: Any) -> None:
        """Checks that involve other sections (called by ``RunConfig.validate``)."""
        if run.data.task != "digits":
            raise ConfigError(f"diffusion runs read data.task: digits (the only image data set so far), got data.task={run.data.task!r}")
        if run.train.algorithm == "rl" and run.reward.name is None:
            raise ConfigError("diffusion RL needs reward.name (e.g. noria.diffusion.rewards:digit_classifier)")
        if run.train.backend != "single":
            raise ConfigError("diffusion runs train on one process (train.backend: single)")
        if run.train.algorithm == "rl" and self.noise_level == 0 and self.objective == "flow_grpo":
            raise ConfigError("diffusion.objective flow_grpo trains on the SDE's log-probabilities: set diffusion.noise_level > 0")
        if run.engine.deterministic and run.train.lora.enabled and run.train.lora.sync == "merged":
            raise ConfigError(
                "engine.deterministic with train.lora.sync: merged: an engine holding merged weights cannot compute what "
                "base + adapter computes in the trainer bit for bit; use train.lora.sync: adapter"
            )
