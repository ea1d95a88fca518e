"""``RunConfig``: a whole job (every section), the checks across sections, the resolved values.

``validate()`` runs each section's own checks, then the rules that tie sections together (the
launchers' placement needs, on-policy distillation's teacher, SFT's and the reward model's data, asynchronous RL's
off-policy correction); ``resolve()`` fills in derived values by named steps (``resolve_batch``,
``resolve_dtypes``). ``load_config`` is the one way a config file becomes a ``RunConfig``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from noria.config.data import DataConfig
from noria.config.diffusion import DiffusionConfig
from noria.config.engine import EngineConfig
from noria.config.eval import EvalConfig
from noria.config.log import LogConfig
from noria.config.model import ModelConfig
from noria.config.opd import OpdConfig
from noria.config.ray import RayConfig
from noria.config.reward import RewardConfig
from noria.config.rollout import RolloutConfig
from noria.config.schema import ConfigError, load, option
from noria.config.schema import field_docs as schema_field_docs
from noria.config.sync import SyncConfig
from noria.config.train import TrainConfig


@dataclass
class RunConfig:
    """A whole job: every section, plus the checks across sections (``validate``) and the resolved
    values (``resolve``). Read by the RL job (``noria.launch.job``) and the SFT job (``noria.launch.sft``, which
    also trains reward models)."""

    name: str = option("noria", "Run name; the default run folder is runs/<name>-<time>.")
    seed: int = option(0, "Global seed (torch, python, numpy).")
    run_dir: str | None = option(None, "Run folder; default runs/<name>-<time>.")
    launch: Literal["local", "ray"] = option(
        "local", "Launcher of an RL run: local (processes on this machine) or ray (engines and trainer ranks as Ray "
        "actors in placement groups, on one machine or a cluster; see the ray section)."
    )
    ray: RayConfig = option(factory=RayConfig, help="The Ray launcher (launch: ray).")
    model: ModelConfig = option(factory=ModelConfig, help="The policy model.")
    data: DataConfig = option(factory=DataConfig, help="Prompt source.")
    reward: RewardConfig = option(factory=RewardConfig, help="Reward function.")
    rollout: RolloutConfig = option(factory=RolloutConfig, help="Rollout sampling.")
    engine: EngineConfig = option(factory=EngineConfig, help="The built-in rollout engine.")
    train: TrainConfig = option(factory=TrainConfig, help="The trainer.")
    sync: SyncConfig = option(factory=SyncConfig, help="Weight sync to the engines.")
    eval: EvalConfig = option(factory=EvalConfig, help="Evaluation.")
    log: LogConfig = option(factory=LogConfig, help="Metric sinks.")
    opd: OpdConfig = option(factory=OpdConfig, help="On-policy distillation's teacher (on when train.loss.opd_coef > 0).")
    diffusion: DiffusionConfig | None = option(
        None, "Present (a mapping, `{}` for the defaults): the run trains a flow-matching image model "
        "(noria.diffusion) instead of a language model."
    )

    def validate(self) -> None:
        """Checks only (writes nothing): every section's own rules, then the rules across sections."""
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if dataclasses.is_dataclass(section):
                section.validate()
        if self.reward.name is None and self.data.task is None and self.train.algorithm == "rl":
            raise ConfigError("reward.name is required when prompts come from data.path (only tasks have a default reward)")
        _check_launch(self)
        self.engine.check_model(self.model.device, self.model.impl, rollout_engine=self.rollout.engine)
        _check_opd(self)
        _check_overlong(self)
        _check_qat(self)
        if self.train.algorithm == "reward_model":
            _check_reward_model(self)
        elif self.diffusion is not None:
            self.diffusion.validate_run(self)
        elif self.train.algorithm == "sft":
            _check_sft_data(self.data)
        if self.train.compile and self.engine.deterministic:
            raise ConfigError(
                "train.compile with engine.deterministic: deterministic mode runs the exact-numerics modules, which "
                "compiled kernels would not reproduce; set one of them to false"
            )
        if self.train.algorithm == "rl" and self.rollout.max_staleness > 0 and self.train.loss.off_policy == "none":
            raise ConfigError(
                "rollout.max_staleness > 0 (asynchronous RL) needs an explicit off-policy correction in "
                "train.loss.off_policy: tis (truncated importance weights) or mis (masked outside "
                "[mis_low, mis_high]) with the rollout logprobs as the behaviour policy, seq_is (sequence-level IS), "
                "or recompute (the trainer's recomputed logprobs as the behaviour policy)"
            )

    def resolve(self) -> None:
        """The named steps that fill in derived values, run after ``validate`` by ``load_config`` (the
        saved config holds their results): the batch (``resolve_batch`` for RL; SFT's default
        ``train.global_batch`` of 8), then the dtypes (``resolve_dtypes``), then for RL the KV tokens the
        job can use (``engine.kv_job_tokens``, ``noria.config.engine.job_kv_tokens``)."""
        if self.train.algorithm in ("sft", "reward_model"):
            if self.train.global_batch is None:
                self.train.global_batch = 8
        else:
            resolve_batch(self)
        resolve_dtypes(self)
        if self.train.algorithm == "rl" and self.engine.kv_job_tokens is None:
            from noria.config.engine import job_kv_tokens

            self.engine.kv_job_tokens = job_kv_tokens(self)  # what the job can use bounds the KV cache
        if self.train.loss.opd_coef > 0 and self.opd.placement == "trainer":
            self.train.teacher = self.opd.teacher  # the backend's frozen teacher (compute_logprobs "teacher")


def resolve_dtypes(config: RunConfig) -> None:
    """Fill in ``model.dtype: auto`` for this machine and ``train.param_dtype: auto`` from it, so
    the engine and the trainer compute in one dtype and the saved config names it."""
    config.model.resolve_dtype()
    if config.train.param_dtype == "auto":
        config.train.param_dtype = config.model.dtype


def resolve_batch(config: RunConfig) -> None:
    """Fill in the RL batch invariant ``P * n = G * K`` (prompts per step, samples per prompt,
    global batch, optimizer steps per rollout) from the values set; raise if they disagree.

    ``n`` always has a value (default 8). Of P, G and K: a missing K is 1 unless P and G are both set;
    if P and G are both missing, P is 8 prompts; the one still missing is derived, and must come out
    a whole number. The resolved values are written back, so the saved config holds all four.
    """
    r, t = config.rollout, config.train
    n = r.n_samples
    if t.steps_per_rollout is None and (r.prompts_per_step is None or t.global_batch is None):
        t.steps_per_rollout = 1
    if r.prompts_per_step is None and t.global_batch is None:
        r.prompts_per_step = 8
    k = t.steps_per_rollout
    if r.prompts_per_step is None:
        r.prompts_per_step = _derive(
            t.global_batch * k, f"train.global_batch ({t.global_batch}) * train.steps_per_rollout ({k})",
            n, f"rollout.n_samples ({n})", "rollout.prompts_per_step",
        )  # fmt: skip
    elif t.global_batch is None:
        t.global_batch = _derive(
            r.prompts_per_step * n, f"rollout.prompts_per_step ({r.prompts_per_step}) * rollout.n_samples ({n})",
            k, f"train.steps_per_rollout ({k})", "train.global_batch",
        )  # fmt: skip
    elif k is None:
        t.steps_per_rollout = _derive(
            r.prompts_per_step * n, f"rollout.prompts_per_step ({r.prompts_per_step}) * rollout.n_samples ({n})",
            t.global_batch, f"train.global_batch ({t.global_batch})", "train.steps_per_rollout",
        )  # fmt: skip
    if r.prompts_per_step * n != t.global_batch * t.steps_per_rollout:
        raise ConfigError(
            f"batch invariant broken: rollout.prompts_per_step * rollout.n_samples = {r.prompts_per_step} * {n} = "
            f"{r.prompts_per_step * n}, but train.global_batch * train.steps_per_rollout = {t.global_batch} * "
            f"{t.steps_per_rollout} = {t.global_batch * t.steps_per_rollout}; set three of them and leave the fourth null"
        )


def _derive(product: int, product_text: str, divisor: int, divisor_text: str, target: str) -> int:
    """``product // divisor``; raise naming the keys when it is not a whole number."""
    if product % divisor:
        raise ConfigError(f"batch invariant: {product_text} must be a multiple of {divisor_text} to derive {target}")
    return product // divisor


def _check_launch(config: RunConfig) -> None:
    """What the launchers need of the other sections: a fleet or several trainer ranks in RL run
    disaggregated (the engines are their own processes or actors)."""
    r, t = config.rollout, config.train
    if t.algorithm != "rl" or (config.launch == "local" and t.world_size == 1):
        return
    if r.placement != "disaggregated" or r.engine_url is not None:
        why = "launch: ray" if config.launch == "ray" else "train.world_size > 1"
        raise ConfigError(f"{why} in RL starts its own engines: it needs rollout.placement: disaggregated and no rollout.engine_url")


def _check_opd(config: RunConfig) -> None:
    """On-policy distillation: a teacher is named once (``opd.teacher``, not also ``train.teacher``)."""
    opd, coef = config.opd, config.train.loss.opd_coef
    opd.check_enabled(coef)
    if coef > 0 and config.train.teacher is not None and config.train.teacher != opd.teacher:
        raise ConfigError("train.loss.opd_coef > 0 takes its teacher from opd.teacher; leave train.teacher unset")
    if coef > 0 and config.train.loss.advantage == "gae":
        raise ConfigError("train.loss.opd_coef > 0 shapes an estimator's advantages; advantage: gae (the critic's) is not supported")
    if coef > 0 and opd.placement == "trainer" and not opd.teacher:
        raise ConfigError("opd.placement: trainer loads opd.teacher (a model name or folder) beside the policy")


def _check_overlong(config: RunConfig) -> None:
    """The overlong penalty's buffer lies inside the single-turn generation limit."""
    buffer, r = config.reward.overlong_buffer_tokens, config.rollout
    if buffer and buffer > r.max_new_tokens:
        raise ConfigError(f"reward.overlong_buffer_tokens ({buffer}) must not exceed rollout.max_new_tokens ({r.max_new_tokens})")
    plugin = "agent_fn" if r.agent_fn else "rollout_fn" if r.rollout_fn else None
    if buffer and plugin:
        raise ConfigError(f"reward.overlong_buffer_tokens shapes single-turn rollouts of the built-in generation; rollout.{plugin} "
                          "is set (its episodes bound their own tokens): set it to 0")


def _check_qat(config: RunConfig) -> None:
    """QAT trains the recipe the rollout engine serves: the same integer quantization."""
    qat, served = config.train.qat, config.engine.quantization
    if qat != "none" and qat != served:
        raise ConfigError(f"train.qat is {qat} but engine.quantization is {served}: set both to {qat} (the trainer "
                          "fake-quantizes as the engine serves)")


def _check_sft_data(data: DataConfig) -> None:
    if data.path is None:
        raise ConfigError('train.algorithm sft trains on chat rows: set data.path to a JSONL file of {"messages": [...]} rows')
    if data.format not in ("auto", "jsonl") or (data.format == "auto" and not data.path.endswith(".jsonl")):
        raise ConfigError(f"train.algorithm sft reads JSONL chat rows; data.path {data.path!r} is not a .jsonl file")


def _check_reward_model(config: RunConfig) -> None:
    """A reward model trains every weight of a text model on one machine's trainer (single or fsdp2),
    on pairs from a JSONL file or a task, and reads rows through the model's own chat template."""
    t, data, what = config.train, config.data, "train.algorithm reward_model"
    if config.diffusion is not None:
        raise ConfigError(f"{what} trains a language model; remove the diffusion section")
    if t.backend not in ("single", "fsdp2"):
        raise ConfigError(f"{what} runs on train.backend single or fsdp2, not {t.backend}")
    unsupported = {
        "train.lora.enabled": t.lora.enabled, "train.qat": t.qat != "none", "train.freeze": bool(t.freeze),
        "train.teacher": t.teacher is not None, "train.loss.opd_coef": t.loss.opd_coef > 0,
    }  # fmt: skip
    for key, used in unsupported.items():
        if used:
            raise ConfigError(f"{what} trains every weight of the model and its score head: {key} is not supported; unset it")
    if isinstance(data.chat_template, str):
        raise ConfigError(
            f"{what} renders rows with the model's own chat template (the one its saved folder carries, and the scalar "
            "reward reads with): data.chat_template must be true or false, not a template"
        )
    if data.path is not None:
        jsonl = lambda path: data.format == "jsonl" or (data.format == "auto" and path.endswith(".jsonl"))  # noqa: E731
        for key, path in (("data.path", data.path), ("data.test_path", data.test_path)):
            # else a folder: an RL run's, pairs from its rollouts (a run a chain of commands makes may not exist yet)
            if path is not None and not jsonl(path) and (Path(path).is_file() or (Path(path).suffix and not Path(path).is_dir())):
                raise ConfigError(
                    f'{what} reads JSONL rows of {{"prompt", "chosen", "rejected"}} or an RL run\'s folder (pairs from its '
                    f"rollouts); {key} {path!r} is neither a .jsonl file nor a folder"
                )
        if config.eval.every > 0 and data.test_path is None and jsonl(data.path):
            raise ConfigError(f"eval.every > 0 with {what} evaluates held-out pairs: set data.test_path (a JSONL of pairs) or eval.every: 0")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, cls: type = RunConfig) -> Any:
    """Read YAML ``path`` (optional), apply ``--a.b value`` overrides, type-check, validate, resolve
    (``noria.config.schema.load``): the one way a config file becomes a ``RunConfig``."""
    return load(cls, path, overrides)


def field_docs(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, help) for every leaf field of ``cls``: the configuration reference."""
    return schema_field_docs(cls, prefix)
