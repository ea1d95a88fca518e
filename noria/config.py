"""Noria's configuration: one typed, closed, documented section per component, and ``RunConfig``.

Each section is owned by the component it configures (its docstring names it): the component reads
it, its ``validate()`` holds every check of its own fields, and the docs (``noria docs`` ->
docs/config.md) come from its field help. The classes live here, in one leaf module, so that any
part can import a section without importing the component (``noria.config`` imports only
``noria.errors``, ``noria.config_schema``, the sections kept with their packages as leaves too
(``noria.diffusion.config``, ``noria.distill.config``, ``noria.eval.config``) and, when ``dtype: auto`` is resolved, ``noria.hardware``).

A config is loaded once (``load_config``; the machinery is ``noria.config_schema``): YAML plus
dotted overrides -> typed sections (closed: an unknown key names the closest valid one) ->
``validate()`` (checks only: each section, then across sections) -> ``resolve()`` (the named steps
that fill in derived values: ``resolve_batch``, ``resolve_dtypes``; the saved config holds their
results) -> sections marked validated. Components built from a loaded config do not check it
again; one built from code checks its section once (``noria.config_schema.ensure_valid``).

``to_dict`` / ``save_config`` write the resolved config (every default filled in) into a run folder.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from noria.config_schema import (  # noqa: F401 -- re-exported: callers import them from noria.config
    ConfigError,
    check_sampling,
    ensure_valid,
    from_dict,
    load,
    option,
    parse_overrides,
    save_config,
    to_dict,
)
from noria.config_schema import field_docs as schema_field_docs
from noria.diffusion.config import DiffusionConfig
from noria.distill.config import OpdConfig
from noria.eval.config import EvalConfig
from noria.launch.config import RayConfig
from noria.train.megatron.config import MegatronConfig

DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def check_device(key: str, device: str) -> None:
    """``device`` must be cpu, cuda or cuda:N."""
    if not DEVICE.fullmatch(device):
        raise ConfigError(f"{key} must be cpu, cuda or cuda:N, got {device!r}")


# --------------------------------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    """The policy model. Owner: ``noria.models`` (``load_model``, the catalog); the engine and the trainer
    load it with these settings."""

    path: str = option("", "A catalog name (see `noria models list`) or an HF model folder (config.json + safetensors).")
    dtype: Literal["auto", "bfloat16", "float32"] = option(
        "auto",
        "Compute dtype of the model weights. auto: bfloat16 on CUDA and on CPUs that compute bf16 natively "
        "(AVX512_BF16 or AMX), float32 on other CPUs (AVX2-only ones run bf16 3-5x slower); the resolved dtype is "
        "what the run folder's config.yaml records. `noria info` shows what this machine gets.",
    )
    impl: Literal["auto", "native", "hf"] = option(
        "auto", "auto: Noria's native model when the architecture is supported, else transformers'."
    )
    device: str = option("cpu", "torch device for the model: cpu, cuda, cuda:1, ...")

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("model.path is required: a catalog name such as smollm2-135m-instruct or a folder")

    def resolve_dtype(self) -> None:
        """Replace ``auto`` by this machine's dtype (``noria.hardware.auto_dtype``); warn once when
        an explicit bfloat16 will run slowly on this CPU."""
        from noria import hardware

        if self.dtype == "auto":
            self.dtype = hardware.auto_dtype(self.device)
        else:
            hardware.warn_slow_dtype(self.dtype, self.device)


@dataclass
class DataConfig:
    """Where prompts come from: a file (JSONL, Parquet, HF datasets folder) or a built-in task.
    Owner: ``noria.data`` (``load_prompts``, ``PromptSource``)."""

    task: str | None = option(None, "Built-in synthetic task (arithmetic, countdown); exclusive with `path`.")
    task_args: dict[str, Any] = option(
        factory=dict, help="Task-specific arguments (e.g. n_train, n_test, seed); each task rejects unknown ones."
    )
    path: str | None = option(None, "Training data file or folder (.jsonl, .parquet, or a saved HF dataset).")
    test_path: str | None = option(None, "Held-out data for evaluation, same format as `path`.")
    format: Literal["auto", "jsonl", "parquet", "hf"] = option("auto", "File format; auto picks it from the extension.")
    prompt_key: str = option("prompt", "Field holding the prompt: a string, or a list of chat messages.")
    label_key: str | None = option("label", "Field holding the reference answer; null if the data has none.")
    metadata_keys: list[str] = option(factory=list, help="Extra fields copied into each prompt's metadata.")
    chat_template: bool | str = option(
        True,
        "true: render prompts with the tokenizer's chat template; false: plain text; a path to a Jinja file, or a "
        "Jinja template itself (it holds `{%` or `{{`): render with that template instead of the tokenizer's.",
    )
    system_prompt: str | None = option(None, "System message prepended when rendering string prompts as chat.")
    shuffle: bool = option(True, "Shuffle the training prompts each epoch (seeded).")
    seed: int = option(0, "Seed of the shuffle.")
    epochs: int = option(1, "Passes over the training data; the source stops after this many.")
    max_prompt_tokens: int | None = option(None, "Drop prompts longer than this many tokens at load (count logged).")
    skip_bad_rows: bool = option(False, "Skip malformed rows (counted and reported) instead of failing.")

    def validate(self) -> None:
        if (self.task is None) == (self.path is None):
            raise ConfigError("data: set exactly one of data.task (a built-in task) or data.path (a data file)")
        if self.epochs < 1:
            raise ConfigError(f"data.epochs must be >= 1, got {self.epochs}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ConfigError(f"data.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")


@dataclass
class RewardConfig:
    """How a sample is scored. Owner: ``noria.rewards`` (the registry and the runner)."""

    name: str | None = option(
        None,
        "A registered reward (exact_match, numeric, math, format, countdown) or a user function "
        "`pkg.module:fn`; null uses the built-in task's own reward.",
    )
    kwargs: dict[str, Any] = option(factory=dict, help="Keyword arguments passed to the reward function.")
    timeout_s: float = option(10.0, "Seconds one reward call may take; past that the sample is marked failed.")
    max_concurrency: int = option(32, "Reward calls running at once (threads for sync functions).")

    def validate(self) -> None:
        if self.timeout_s <= 0:
            raise ConfigError(f"reward.timeout_s must be > 0, got {self.timeout_s}")
        if self.max_concurrency < 1:
            raise ConfigError(f"reward.max_concurrency must be >= 1, got {self.max_concurrency}")


@dataclass
class BufferConfig:
    """The group buffer between rollout and trainer. Owner: ``noria.rollout.buffer`` (``build_buffer``,
    the ``Buffer`` protocol)."""

    impl: str = option(
        "",
        "Empty for the built-in GroupBuffer, or an import path `pkg.module:Class` of a class meeting the buffer protocol "
        "(noria.rollout.buffer.Buffer; checked when the run starts): built with capacity, max_staleness, filters and "
        "on_drop keywords; async put(group) (may wait while full; False if dropped), take(n, version) (never waits; "
        "drops groups staler than max_staleness), metrics(version), __len__, state_dict, load_state_dict.",
    )
    capacity_batches: int = option(
        2,
        "Capacity in training batches: the buffer holds at most this many times rollout.prompts_per_step groups; a put "
        "on a full buffer waits (the rollout scheduler stops starting groups).",
    )
    filters: list[str] = option(
        factory=list,
        help="Group filters applied on put, in order: zero_reward_variance (dynamic sampling: every reward equal), "
        "over_length (a sample hit rollout.max_new_tokens), or an import path `pkg.module:fn` with fn(group) -> None "
        "(keep) or a drop reason (str).",
    )
    on_drop: Literal["discard", "return"] = option(
        "discard",
        "What happens to the prompt of a dropped group: discarded, or returned to the data source (it is drawn again "
        "before any new prompt).",
    )
    max_consecutive_drops: int = option(
        64,
        "Groups dropped in a row (none trained in between) after which the run stops with an error naming the drop "
        "reasons and an example failure (a reward that always fails, a filter that keeps nothing, staleness).",
    )

    def validate(self) -> None:
        if self.capacity_batches < 1:
            raise ConfigError(f"rollout.buffer.capacity_batches must be >= 1, got {self.capacity_batches}")
        if self.max_consecutive_drops < 1:
            raise ConfigError(f"rollout.buffer.max_consecutive_drops must be >= 1, got {self.max_consecutive_drops}")
        if self.impl and ":" not in self.impl:
            raise ConfigError(f"rollout.buffer.impl must be an import path pkg.module:Class, got {self.impl!r}")
        for name in self.filters:
            if name not in ("zero_reward_variance", "over_length") and ":" not in name:
                raise ConfigError(
                    f"rollout.buffer.filters: unknown filter {name!r}; use zero_reward_variance, over_length "
                    "or an import path pkg.module:fn"
                )


@dataclass
class RolloutConfig:
    """Sampling of training trajectories. Owner: ``noria.rollout`` (``RolloutContext`` and the
    scheduler); its placement fields are read by the launcher (``noria.launch.local``)."""

    n_samples: int = option(8, "Samples per prompt (the group size).")
    max_new_tokens: int = option(256, "Maximum generated tokens per sample.")
    temperature: float = option(1.0, "Sampling temperature; 0 is greedy.")
    top_p: float = option(1.0, "Nucleus sampling: keep the smallest token set with this much probability.")
    top_k: int = option(-1, "Keep only the k most likely tokens; -1 keeps all.")
    min_p: float = option(0.0, "Drop tokens whose probability is below min_p times the top token's.")
    stop: list[str] = option(factory=list, help="Stop strings; generation ends after the first one produced.")
    prompts_per_step: int | None = option(
        None,
        "Prompts sampled per rollout step. Batch invariant: prompts_per_step * n_samples = "
        "train.global_batch * train.steps_per_rollout; set three, the fourth is derived.",
    )
    rollout_fn: str = option(
        "", "Import path `pkg.module:fn` of a rollout function `async (ctx, prompts) -> list[Group]` that replaces "
        "the whole rollout (noria.agent.plugins); empty for the built-in one."
    )
    generate_fn: str = option(
        "", "Import path `pkg.module:fn` of a generate function `async (ctx, sample) -> Sample` (one trajectory; "
        "it records its own tokens); empty for the built-in single-turn one."
    )
    agent_fn: str = option(
        "", "Import path `pkg.module:fn` of an agent function `async (ctx, prompt, base_url) -> dict` that talks "
        "OpenAI chat completions to the session server, which records the tokens (multi-turn, tools)."
    )
    agent_timeout_s: float = option(600.0, "Seconds one agent function may run; past it the sample is FAILED.")
    session_on_mismatch: Literal["error", "rerender"] = option(
        "error", "When an agent re-sends a history that differs from the session's record: error (HTTP 409, the "
        "sample fails) or rerender (the record restarts from the re-rendered history; earlier policy tokens leave it)."
    )
    placement: Literal["colocated", "disaggregated"] = option(
        "colocated",
        "colocated: the engine runs in the trainer's process and pauses (KV memory released) while it trains; "
        "disaggregated: the engine is its own `noria serve` process (or the server at engine_url).",
    )
    engine_url: str | None = option(None, "disaggregated: base URL of a running engine server (of rollout.engine's API); null starts one.")
    engine: Literal["noria", "sglang", "vllm"] = option(
        "noria", "disaggregated: the engine server's API: noria (`noria serve`, started by the run or at engine_url), sglang (an "
        "SGLang server at engine_url), vllm (a vLLM server at engine_url, or started by the run); see docs/engines.md.")
    engine_device: str | None = option(
        None,
        "disaggregated: torch device of the `noria serve` engine the run starts (its --device), e.g. cuda:0 while "
        "train.device is cuda:1; null uses model.device. The trainer stays on train.device.",
    )
    engines: int = option(
        1, "disaggregated: rollout engines (`noria serve` processes, or Ray actors under launch: ray); more than one "
        "sit behind the real sglang-router (load-based for single turns, session-key affinity for sessions)."
    )
    engine_restarts: int = option(
        2, "Times one engine is restarted after it died (its in-flight groups are regenerated, it is re-synced to the "
        "current weights); past that, or with no engine left alive, the run stops naming the engine."
    )
    max_staleness: int = option(
        0, "Largest allowed trainer version minus the oldest weight version in a group; 0 is synchronous RL."
    )
    engine_timeout_s: float = option(
        600.0, "Seconds one rollout request may take before the engine is declared dead and the run stops."
    )
    max_in_flight: int | None = option(
        None,
        "Trajectories generating at once at most (the rollout scheduler's places); null is prompts_per_step * n_samples "
        "(one step's worth).",
    )
    granularity: Literal["auto", "group", "sample"] = option(
        "auto",
        "When places free up: group (when every trajectory of a group has finished) or sample (each finished trajectory "
        "frees its place; a new group starts once n_samples places are free). auto: sample when max_staleness > 0, else group.",
    )
    pause_mode: Literal["retract", "in_place", "drain"] = option(
        "retract",
        "How a disaggregated engine takes a weight update during generation: retract (in-flight requests are aborted and "
        "resumed from their partial tokens under the new weights), in_place (generation pauses, the weights change, it continues "
        "with its KV cache) or drain (no request starts; the update waits for the running ones: the mode of vLLM, which reports no versions).",
    )
    routing_replay: bool = option(
        False,
        "MoE models: the engine records the experts each policy token was routed to (per MoE layer) and the trainer's "
        "MoE layers use them, with gate weights from its own router (rollout routing replay, R3). Implies record_routes.",
    )
    record_routes: bool = option(
        False,
        "MoE models: record the engine's routes and log moe/route_mismatch without replaying them (the trainer routes "
        "by itself); routing_replay records them anyway.",
    )
    buffer: BufferConfig = option(factory=lambda: BufferConfig(), help="The group buffer between rollout and trainer.")

    @property
    def wants_routes(self) -> bool:
        """Whether rollout asks the engine for routes (``routing_replay`` or ``record_routes``)."""
        return self.routing_replay or self.record_routes

    def validate(self) -> None:
        check_sampling("rollout", self.temperature, self.top_p, self.top_k, self.min_p, self.max_new_tokens)
        plugins = [k for k in ("rollout_fn", "generate_fn", "agent_fn") if getattr(self, k)]
        if len(plugins) > 1:
            raise ConfigError(f"rollout: set at most one of rollout_fn, generate_fn, agent_fn (got {', '.join(plugins)})")
        for k in plugins:
            if ":" not in getattr(self, k):
                raise ConfigError(f"rollout.{k} must be an import path pkg.module:fn, got {getattr(self, k)!r}")
        if self.agent_timeout_s <= 0:
            raise ConfigError(f"rollout.agent_timeout_s must be > 0, got {self.agent_timeout_s}")
        if self.n_samples < 1:
            raise ConfigError(f"rollout.n_samples must be >= 1, got {self.n_samples}")
        if self.prompts_per_step is not None and self.prompts_per_step < 1:
            raise ConfigError(f"rollout.prompts_per_step must be >= 1 or null, got {self.prompts_per_step}")
        if self.max_staleness < 0:
            raise ConfigError(f"rollout.max_staleness must be >= 0, got {self.max_staleness}")
        if self.engines < 1 or self.engine_restarts < 0:
            raise ConfigError(f"rollout.engines must be >= 1 and rollout.engine_restarts >= 0, got {self.engines}, {self.engine_restarts}")
        if self.engines > 1 and (self.placement != "disaggregated" or self.engine_url is not None):
            raise ConfigError("rollout.engines > 1 starts a fleet of `noria serve` engines: it needs rollout.placement: "
                              "disaggregated and no rollout.engine_url")
        if self.engine_timeout_s <= 0:
            raise ConfigError(f"rollout.engine_timeout_s must be > 0, got {self.engine_timeout_s}")
        if self.engine != "noria" and (self.placement != "disaggregated" or self.engines > 1 or (self.engine == "sglang" and not self.engine_url)):
            raise ConfigError(f"rollout.engine {self.engine} is one engine server: it needs rollout.placement: disaggregated, rollout.engines: 1"
                              + (" and rollout.engine_url (Noria does not start SGLang)" if self.engine == "sglang" else ""))
        if self.engine_url is not None and self.placement != "disaggregated":
            raise ConfigError("rollout.engine_url names an external engine: it needs rollout.placement: disaggregated")
        if self.engine_device is not None:
            if self.placement != "disaggregated" or self.engine_url is not None:
                raise ConfigError(
                    "rollout.engine_device places the `noria serve` engine the run starts: it needs rollout.placement: "
                    "disaggregated and no rollout.engine_url (a colocated engine uses model.device)"
                )
            check_device("rollout.engine_device", self.engine_device)
        if self.max_staleness > 0 and self.placement == "colocated":
            raise ConfigError(
                "rollout.max_staleness > 0 (asynchronous RL) needs rollout.placement: disaggregated; a colocated engine "
                "pauses while the trainer runs, so it cannot generate ahead"
            )
        if self.max_in_flight is not None and self.max_in_flight < self.n_samples:
            raise ConfigError(
                f"rollout.max_in_flight must be >= rollout.n_samples ({self.n_samples}) or null, got {self.max_in_flight}"
            )
        self.buffer.validate()


@dataclass
class EngineConfig:
    """The built-in rollout engine: batching limits, KV cache, prefix cache, numerics. Owner:
    ``noria.engine.Engine`` (``noria serve`` takes it as ``--engine.*``)."""

    max_running_requests: int = option(256, "Requests decoded together at most; more wait in the queue.")
    max_batch_tokens: int = option(4096, "Tokens (prefill chunks plus decode tokens) in one forward step at most.")
    chunked_prefill_size: int = option(512, "Longest prefill chunk of one request per step; long prompts take several steps.")
    block_size: int = option(16, "Tokens per KV-cache block (the page size of the block tables).")
    kv_cache_tokens: int | None = option(
        None, "KV-cache capacity in tokens; null sizes it from kv_memory_fraction of free memory."
    )
    kv_memory_fraction: float = option(0.3, "Share of free memory given to the KV cache when kv_cache_tokens is null.")
    max_context: int | None = option(None, "Longest prompt + output in tokens; null uses the model's max positions.")
    prefix_cache: bool = option(True, "Reuse KV blocks of shared prompt prefixes (radix tree, LRU eviction).")
    deterministic: bool = option(
        False, "Batch-invariant numerics: a request gives the same tokens and logprobs whatever else is batched."
    )
    attention: Literal["auto", "torch", "cpu_kernel"] = option(
        "auto", "Decode attention: the C++ paged kernel on CPU (auto), or gather + torch SDPA."
    )
    overlap: Literal["auto", "on", "off"] = option(
        "auto", "Launch the next decode step before the current one's tokens reach the host (they are fed on the "
        "device), hiding the host's per-step work; auto: on where decode steps run as CUDA graphs."
    )
    quantization: Literal["none", "fp8"] = option(
        "none", "Rollout weights: none (the model dtype) or fp8 (e4m3 decoder-block linears, per-channel weight and "
        "per-row activation scales; bf16 models; pair with train.loss.off_policy: tis)."
    )

    def validate(self) -> None:
        for key in ("max_running_requests", "max_batch_tokens", "chunked_prefill_size", "block_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"engine.{key} must be >= 1, got {getattr(self, key)}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ConfigError(f"engine.kv_cache_tokens must be >= engine.block_size, got {self.kv_cache_tokens}")
        if not 0 < self.kv_memory_fraction <= 0.95:
            raise ConfigError(f"engine.kv_memory_fraction must be in (0, 0.95], got {self.kv_memory_fraction}")
        if self.chunked_prefill_size > self.max_batch_tokens:
            raise ConfigError("engine.chunked_prefill_size must not exceed engine.max_batch_tokens")
        if self.quantization == "fp8" and self.deterministic:
            raise ConfigError(
                "engine.quantization=fp8 cannot be combined with engine.deterministic (deterministic mode runs the "
                "trainer's own bf16 numerics)"
            )


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule (fp32 master weights and optimizer state). Owner:
    ``noria.train.optim``."""

    lr: float = option(1e-6, "Peak learning rate.")
    weight_decay: float = option(0.0, "Decoupled weight decay.")
    betas: list[float] = option(factory=lambda: [0.9, 0.999], help="AdamW betas [beta1, beta2].")
    eps: float = option(1e-8, "AdamW epsilon.")
    schedule: Literal["constant", "linear", "cosine"] = option("constant", "Learning-rate schedule after warmup.")
    warmup_steps: int = option(0, "Optimizer steps of linear warmup from 0 to lr.")
    total_steps: int | None = option(None, "Steps the decaying schedules run over; null uses the run's step count.")
    min_lr_ratio: float = option(0.0, "Floor of the decaying schedules, as a fraction of lr.")
    grad_clip: float | None = option(1.0, "Clip the global gradient norm to this; null disables.")

    def validate(self) -> None:
        if self.lr < 0 or self.weight_decay < 0 or self.eps <= 0:
            raise ConfigError("train.optim: lr and weight_decay must be >= 0 and eps > 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"train.optim.betas must be two numbers in [0, 1), got {self.betas}")
        if self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("train.optim: warmup_steps must be >= 0 and min_lr_ratio in [0, 1]")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError(f"train.optim.grad_clip must be > 0 or null, got {self.grad_clip}")


@dataclass
class LossConfig:
    """The RL objective: advantage estimator, policy loss, aggregation, KL, entropy, off-policy correction.

    Each name is a key of a plain registry in ``noria.train.algorithms``. Owner: ``noria.train.objective``.
    """

    advantage: str = option("grpo", "Advantage estimator: grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, gae.")
    normalize_std: bool = option(True, "GRPO: divide by the group's reward std (false gives Dr.GRPO-style centring only).")
    policy_loss: str = option("ppo_clip", "Policy loss: ppo_clip, gspo, cispo.")
    clip_low: float = option(0.2, "Lower clip range eps_low: ratios below 1 - eps_low are clipped.")
    clip_high: float = option(0.28, "Upper clip range eps_high (clip-higher when > clip_low).")
    dual_clip: float | None = option(None, "Dual-clip constant c (> 1) bounding the loss for negative advantages; null disables.")
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = option(
        "token_mean", "How per-token losses are reduced; normalisers are computed over the whole step, not per micro-batch."
    )
    seq_sum_divisor: float | None = option(
        None, "seq_mean_token_sum: also divide each sequence's token sum by this constant (Dr.GRPO: the max response length); null divides by the sequence count only."
    )
    kl_coef: float = option(0.0, "Weight of the KL penalty against the reference model (0 loads no reference).")
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = option("low_var_kl", "KL estimator.")
    opd_coef: float = option(
        0.0, "On-policy distillation (the opd section names the teacher): per token, lambda * (log pi_student - "
        "log pi_teacher) is subtracted from any estimator's advantages; 0 is off."
    )
    entropy_coef: float = option(0.0, "Weight of the entropy bonus.")
    off_policy: Literal["none", "tis", "mis", "seq_is", "recompute"] = option(
        "none",
        "Correction using rollout logprobs as the behaviour policy: token-level truncated IS, masked IS (icepop), or "
        "sequence-level IS; recompute: the trainer's recomputed logprobs are the behaviour policy (no weight; the "
        "explicit choice for asynchronous RL, where none is refused).",
    )
    is_cap: float = option(2.0, "TIS / sequence IS: upper cap of the importance weight.")
    mis_low: float = option(0.5, "MIS: tokens whose importance weight is below this are masked.")
    mis_high: float = option(2.0, "MIS: tokens whose importance weight is above this are masked.")
    gamma: float = option(1.0, "GAE / REINFORCE++ discount.")
    lam: float = option(0.95, "GAE lambda.")
    value_coef: float = option(0.5, "PPO with GAE: weight of the value loss.")
    router_aux_coef: float = option(
        0.0,
        "MoE models: weight of the routers' load-balancing loss (transformers' load_balancing_loss_func over every MoE "
        "layer; k at perfect balance). 0 (RL's usual choice) computes none.",
    )

    def validate(self) -> None:
        if self.router_aux_coef < 0:
            raise ConfigError(f"train.loss.router_aux_coef must be >= 0, got {self.router_aux_coef}")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ConfigError("train.loss.clip_low and clip_high must be >= 0")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"train.loss.dual_clip must be > 1 or null, got {self.dual_clip}")
        if self.kl_coef < 0 or self.entropy_coef < 0 or self.opd_coef < 0:
            raise ConfigError("train.loss.kl_coef, entropy_coef and opd_coef must be >= 0")
        if self.seq_sum_divisor is not None and self.seq_sum_divisor <= 0:
            raise ConfigError(f"train.loss.seq_sum_divisor must be > 0 or null, got {self.seq_sum_divisor}")
        if not 0 < self.mis_low < 1 < self.mis_high or self.is_cap <= 0:
            raise ConfigError("train.loss: need 0 < mis_low < 1 < mis_high and is_cap > 0")


@dataclass
class CriticConfig:
    """The value model of PPO with GAE (``train.loss.advantage: gae``). Owner: ``noria.train.critic``."""

    path: str | None = option(None, "Critic's starting weights (catalog name or HF folder); null starts from the policy's model.")
    lr: float = option(1e-5, "Critic learning rate (its own AdamW; the other optimizer settings are train.optim's).")
    value_clip: float | None = option(
        0.5, "Clip range of the value update around the rollout-time value (PPO2's clipped value loss); null disables."
    )

    def validate(self) -> None:
        if self.lr < 0:
            raise ConfigError(f"train.critic.lr must be >= 0, got {self.lr}")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ConfigError(f"train.critic.value_clip must be > 0 or null, got {self.value_clip}")


@dataclass
class LoraConfig:
    """LoRA adapters through peft (only adapter parameters are trained). Owner: ``noria.train.lora``."""

    enabled: bool = option(False, "Train LoRA adapters instead of all weights.")
    rank: int = option(16, "Adapter rank r.")
    alpha: float = option(32.0, "Adapter scaling alpha (the update is scaled by alpha / r).")
    dropout: float = option(0.0, "Dropout on the adapter input.")
    target_modules: list[str] = option(
        factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        help="Linear layers that get adapters.",
    )
    sync: Literal["merged", "adapter"] = option("merged", "Send the engine merged weights, or the adapters alone.")
    adapter_path: str | None = option(
        None, "Start from an existing peft adapter folder (adapter_config.json + adapter_model.safetensors) of the same "
        "rank, alpha and target modules; null starts from fresh adapters. The final export writes the adapters alone "
        "to RUN/final/adapter besides the merged model.",
    )

    def validate(self) -> None:
        if self.rank < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ConfigError("train.lora: rank must be >= 1, alpha > 0, dropout in [0, 1)")


@dataclass
class TrainConfig:
    """The trainer: backend, precision, batching, objective, optimizer, checkpoints. Owner:
    ``noria.train.FSDPBackend``; the RL step (``noria.train.rl_step``) reads ``steps_per_rollout``."""

    algorithm: Literal["rl", "sft"] = option("rl", "rl: policy-gradient on rollouts; sft: supervised fine-tuning on chat data.")
    backend: Literal["fsdp2", "single", "megatron"] = option("single", "single: one process; fsdp2: torch fully_shard over world_size processes; megatron: megatron-core (CUDA; docs/megatron.md).")
    world_size: int = option(1, "Trainer processes (fsdp2).")
    device: str = option("cpu", "cpu or cuda; fsdp2 uses gloo on CPU and NCCL on CUDA.")
    param_dtype: Literal["auto", "bfloat16", "float32"] = option(
        "auto", "Compute dtype; master weights and optimizer state stay fp32. auto: model.dtype (resolved)."
    )
    activation_checkpointing: bool = option(False, "Recompute each layer's activations in backward to save memory.")
    compile: bool = option(
        False,
        "torch.compile each decoder layer of the trained model (fused norm, RoPE and SwiGLU kernels; attention stays "
        "eager). The first steps compile (tens of seconds); not with engine.deterministic.",
    )
    micro_batch_tokens: int = option(4096, "Packed tokens per micro-batch (a sequence longer than this gets its own).")
    share_prefix: bool = option(
        True,
        "Pack consecutive sequences that start with the same untrained tokens (a group's prompt) around one copy "
        "of them; same loss, fewer tokens through the model.",
    )
    optim: OptimConfig = option(factory=OptimConfig, help="Optimizer.")
    loss: LossConfig = option(factory=LossConfig, help="RL objective.")
    lora: LoraConfig = option(factory=LoraConfig, help="LoRA.")
    critic: CriticConfig = option(factory=CriticConfig, help="Value model for PPO with GAE.")
    megatron: MegatronConfig = option(factory=MegatronConfig, help="megatron-core parallelism (backend: megatron).")
    max_nonfinite_skips: int = option(0, "Consecutive steps with a non-finite loss or grad norm to skip before stopping.")
    logprob_chunk_tokens: int = option(1024, "Tokens per chunk when computing logprobs from hidden states (bounds [N, V] memory).")
    teacher: str | None = option(
        None, "Teacher model (catalog name or HF folder) for compute_logprobs(which='teacher'), e.g. on-policy distillation; null loads none."
    )
    global_batch: int | None = option(
        None,
        "Sequences per optimizer step (SFT: chat rows, default 8; the last step of the data may have fewer). "
        "RL: derived from the batch invariant when null (see rollout.prompts_per_step).",
    )
    steps_per_rollout: int | None = option(
        None, "RL: optimizer steps taken on each rollout step's samples (split into global_batch slices); null derives it (default 1)."
    )
    max_steps: int | None = option(None, "Stop after this many optimizer steps; null runs until data.epochs passes are done.")
    save_every: int = option(0, "Optimizer steps between checkpoints in RUN_DIR/checkpoints (what --resume restarts from); 0 saves none.")
    max_seq_tokens: int | None = option(
        2048, "SFT: chats longer than this many tokens are cut on the right (their tail is not trained on); null keeps them whole."
    )

    def validate(self) -> None:
        if self.world_size < 1 or self.micro_batch_tokens < 1 or self.logprob_chunk_tokens < 1:
            raise ConfigError("train: world_size, micro_batch_tokens and logprob_chunk_tokens must be >= 1")
        if self.backend == "single" and self.world_size != 1:
            raise ConfigError("train.world_size > 1 needs train.backend: fsdp2")
        if self.max_nonfinite_skips < 0:
            raise ConfigError("train.max_nonfinite_skips must be >= 0")
        if self.teacher is not None and not self.teacher.strip():
            raise ConfigError("train.teacher must be a model name or folder, or null")
        if self.save_every < 0:
            raise ConfigError(f"train.save_every must be >= 0, got {self.save_every}")
        for key in ("max_steps", "max_seq_tokens", "global_batch", "steps_per_rollout"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"train.{key} must be >= 1 or null, got {getattr(self, key)}")
        for section in (self.optim, self.loss, self.lora, self.critic, self.megatron):
            section.validate()
        if self.backend == "megatron":
            self.megatron.check_train(self)


@dataclass
class SyncConfig:
    """Weight sync from the trainer to the rollout engines. Owner: ``noria.sync`` (``build_sync``)."""

    transport: Literal["auto", "ipc", "broadcast", "disk"] = option(
        "auto",
        "ipc: in process or shared memory; broadcast: torch.distributed group from trainer rank 0 (gloo / NCCL); disk: "
        "safetensors folder the engine loads. auto, by where engines are: ipc on this machine (except from a GPU to "
        "another GPU: broadcast), disk for an engine on another machine, an external engine_url or vLLM.",
    )
    bucket_mb: int = option(256, "Tensors are sent in buckets of about this many MiB.")
    verify: bool = option(False, "After every update, compare a checksum of every engine tensor with the trainer's.")
    disk_dir: str | None = option(None, "disk transport: folder the weights are written to; null uses RUN_DIR/weights.")
    delta: bool = option(
        False,
        "disk transport: write only what changed since the last version (XOR, compressed, per-tensor checksums); an "
        "engine not serving that version, or refusing the delta, gets a full snapshot. noria engines only (SGLang and "
        "vLLM load full folders: refused at start). See docs/concepts.md.",
    )
    broadcast_backend: Literal["auto", "nccl", "gloo"] = option(
        "auto",
        "broadcast transport's group: nccl (CUDA weights, the engine on another GPU), gloo (any tensors; CUDA ones "
        "travel through host memory). auto: nccl when the trainer's weights are on CUDA, except gloo when the RL "
        "job's engine is on the trainer's own GPU (NCCL cannot hold two ranks on one GPU).",
    )

    def validate(self) -> None:
        if self.bucket_mb < 1:
            raise ConfigError(f"sync.bucket_mb must be >= 1, got {self.bucket_mb}")
        if self.delta and self.transport != "disk":
            raise ConfigError(f"sync.delta writes deltas to disk: it needs sync.transport: disk, not {self.transport}")


@dataclass
class LogConfig:
    """Metric sinks: JSONL in the run folder always, TensorBoard and W&B on request. Owner:
    ``noria.metrics`` (``RunLog``)."""

    loggers: list[str] = option(
        factory=lambda: ["jsonl"],
        help="Metric sinks: jsonl (RUN_DIR/metrics.jsonl, always on), tensorboard (RUN_DIR/tensorboard), "
        "wandb (RUN_DIR/wandb; needs `pip install wandb`).",
    )
    wandb_project: str = option("noria", "W&B project name.")
    wandb_mode: Literal["offline", "online"] = option(
        "offline", "offline: no network or account needed (`wandb sync RUN_DIR/wandb/offline-run-*` uploads later); "
        "online: streams to the W&B server."
    )

    def validate(self) -> None:
        import importlib.util

        for name in self.loggers:
            if name not in ("jsonl", "tensorboard", "wandb"):
                raise ConfigError(f"log.loggers: unknown sink {name!r}; use jsonl, tensorboard or wandb")
            if name != "jsonl" and importlib.util.find_spec(name) is None:
                raise ConfigError(f"log.loggers: {name} is not installed here (pip install {name})")


@dataclass
class RunConfig:
    """A whole job: every section, plus the checks across sections (``validate``) and the resolved
    values (``resolve``). Read by the launcher (``noria.launch.local``) and the SFT job."""

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
        _check_opd(self)
        if self.diffusion is not None:
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
        ``train.global_batch`` of 8), then the dtypes (``resolve_dtypes``)."""
        if self.train.algorithm == "sft":
            if self.train.global_batch is None:
                self.train.global_batch = 8
        else:
            resolve_batch(self)
        resolve_dtypes(self)
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


def _check_sft_data(data: DataConfig) -> None:
    if data.path is None:
        raise ConfigError('train.algorithm sft trains on chat rows: set data.path to a JSONL file of {"messages": [...]} rows')
    if data.format not in ("auto", "jsonl") or (data.format == "auto" and not data.path.endswith(".jsonl")):
        raise ConfigError(f"train.algorithm sft reads JSONL chat rows; data.path {data.path!r} is not a .jsonl file")


# ---------------------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, cls: type = RunConfig) -> Any:
    """Read YAML ``path`` (optional), apply ``--a.b value`` overrides, type-check, validate, resolve
    (``noria.config_schema.load``): the one way a config file becomes a ``RunConfig``."""
    return load(cls, path, overrides)


def field_docs(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, help) for every leaf field of ``cls``: the configuration reference."""
    return schema_field_docs(cls, prefix)
