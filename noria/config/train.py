"""The ``train`` section: the trainer, its optimizer, loss, critic and LoRA adapters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from noria.config.megatron import MegatronConfig
from noria.config.schema import ConfigError, option


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
    state_dtype: Literal["float32", "bfloat16", "int8"] = option(
        "float32",
        "How AdamW stores its two moments: float32 (8 bytes per trained parameter), bfloat16 (4) or int8 (block-wise "
        "8-bit, about 2; noria.train.compact_adamw). The update is computed in fp32 on the fp32 weights either way. "
        "Not with backend fsdp2 or megatron.",
    )

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
    vision: bool = option(
        False, "Vision-language models: also put adapters on the vision tower and connector layers that match "
        "target_modules; by default only the language model is adapted.",
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

    algorithm: Literal["rl", "sft", "reward_model"] = option(
        "rl", "rl: policy-gradient on rollouts; sft: supervised fine-tuning on chat data; reward_model: a scalar reward "
        "model (pairwise Bradley-Terry) trained on preference pairs (data.path: JSONL of {prompt, chosen, rejected}, or "
        "pairs made from data.task: the right answer preferred), saved as a sequence-classification folder for "
        "reward.model (kind scalar)."
    )
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
    offload_optimizer: bool = option(
        False,
        "CUDA, rollout.placement colocated: the optimizer state (Adam's moments: 8 bytes a parameter, about 2 with "
        "train.optim.state_dtype int8) moves to pinned host memory while the engine generates and back for the "
        "trainer's turn (exact copies: the same training). The engine's KV cache then has that memory to itself. "
        "Measured on one H100, a Qwen3-0.6B-shaped model, int8 moments: 1.21 GB moved out and back in 0.028 s a step.",
    )
    share_prefix: bool = option(
        True,
        "Share the tokens the batch's sequences have in common (prompts, common starts of responses, earlier turns) "
        "through a prefix tree: each goes through forward and backward once; the same losses and gradients, fewer "
        "tokens through the model (a tree holds at most train.micro_batch_tokens tokens).",
    )
    skip_zero_advantage: bool = option(
        True,
        "RL: leave out of the forward and backward the samples whose gradient is zero: advantage 0 on every token "
        "(a GRPO group whose rewards are all equal) with no KL, entropy or router-balance term, under a policy loss that "
        "scales every term by the advantage (ppo_clip, gspo, cispo; a plugin's loss only if registered so). The losses still "
        "divide by the whole step's token and sequence counts, so the gradient is the same (to float rounding); "
        "the step's logprob metrics (clip_frac, approx_kl, rollout_logprob_abs_diff, ...) then cover the samples "
        "trained through the model. One sample is kept when none has a gradient, so the optimizer still steps.",
    )
    optim: OptimConfig = option(factory=OptimConfig, help="Optimizer.")
    loss: LossConfig = option(factory=LossConfig, help="RL objective.")
    lora: LoraConfig = option(factory=LoraConfig, help="LoRA.")
    qat: Literal["none", "int8", "int4", "fp8"] = option(
        "none", "Quantization-aware training: the decoder blocks' linear layers compute with their weights quantized "
        "and dequantized exactly as the quantized rollout engine serves them (engine.quantization, the same value; "
        "straight-through gradients), so the policy trained is the policy that rolls out. int8 / int4: with "
        "engine.deterministic the rollout and trainer logprobs are equal bit for bit. fp8: the inputs are quantized per "
        "row too, as the FP8 engine's matmul reads them; closer, not equal (the FP8 matmul sums in its own order).",
    )
    freeze: list[Literal["vision", "connector"]] = option(
        factory=list, help="Vision-language models: parts kept frozen (never updated): vision (the vision tower), "
        "connector (the projection of image features into the language model). Refused for a text-only model.",
    )
    critic: CriticConfig = option(factory=CriticConfig, help="Value model for PPO with GAE.")
    megatron: MegatronConfig = option(factory=MegatronConfig, help="megatron-core parallelism (backend: megatron).")
    max_nonfinite_skips: int = option(0, "Consecutive steps with a non-finite loss or grad norm to skip before stopping.")
    logprob_chunk_tokens: int = option(1024, "Tokens per chunk when computing logprobs from hidden states (bounds [N, V] memory).")
    onednn_cache_capacity: int | None = option(
        None,
        "CPU: entries of oneDNN's primitive cache and of ideep's matmul cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY, "
        "LRU_CACHE_CAPACITY; default 1024 each) in the noria train process; every new matmul shape (the trainer's "
        "change with each batch) caches a compiled kernel, which grew the main job's peak RSS 2.95 -> 3.24 GB over 20 "
        "steps. null: the defaults; a value in the environment wins (noria.train.memory).",
    )
    teacher: str | None = option(
        None, "Teacher model (catalog name or HF folder) for compute_logprobs(which='teacher'), e.g. on-policy distillation; null loads none."
    )
    global_batch: int | None = option(
        None,
        "Sequences per optimizer step (SFT: chat rows, default 8; reward_model: preference pairs, default 8; the last "
        "step of the data may have fewer). "
        "RL: derived from the batch invariant when null (see rollout.prompts_per_step).",
    )
    steps_per_rollout: int | None = option(
        None, "RL: optimizer steps taken on each rollout step's samples (split into global_batch slices); null derives it (default 1)."
    )
    max_steps: int | None = option(None, "Stop after this many optimizer steps; null runs until data.epochs passes are done.")
    save_every: int = option(
        0, "Steps between checkpoints in RUN_DIR/checkpoints (what --resume restarts from); 0 saves none during the run "
        "(the end of the run still saves one: save_final_state)."
    )
    save_final_state: bool = option(
        True, "At the end of a run, save a checkpoint of its last step in RUN_DIR/checkpoints beside final/ (weights, "
        "optimizer state, RNG, data cursor, buffer, weight version), even with save_every 0, so that --resume RUN_DIR "
        "--train.max_steps N extends the finished run. Costs about 13 bytes per trained parameter on disk (fp32 weights "
        "and the two AdamW moments: 1.73 GB for SmolLM2-135M, 6.3x its final/ in bf16); false saves none at the end, "
        "and such a run can only be restarted (--restart) or started anew from final/."
    )
    max_seq_tokens: int | None = option(
        2048, "SFT: chats longer than this many tokens are cut on the right (their tail is not trained on); reward_model: "
        "a pair with a longer side is refused (the score is read at the end); null keeps them whole."
    )

    def validate(self) -> None:
        if self.world_size < 1 or self.micro_batch_tokens < 1 or self.logprob_chunk_tokens < 1:
            raise ConfigError("train: world_size, micro_batch_tokens and logprob_chunk_tokens must be >= 1")
        if self.backend == "single" and self.world_size != 1:
            raise ConfigError("train.world_size > 1 needs train.backend: fsdp2")
        if self.onednn_cache_capacity is not None and self.onednn_cache_capacity < 1:
            raise ConfigError(f"train.onednn_cache_capacity must be >= 1 or null, got {self.onednn_cache_capacity}")
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
        if self.optim.state_dtype != "float32" and self.backend != "single":
            raise ConfigError(f"train.optim.state_dtype {self.optim.state_dtype} needs train.backend: single")
