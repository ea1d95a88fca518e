"""The ``engine`` section: the built-in rollout engine (``noria serve`` and the in-process engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from noria.config.schema import ConfigError, option


@dataclass
class SpeculativeConfig:
    """Speculative decoding in the built-in engine: a drafter proposes tokens, the model verifies
    them in one forward, and exact rejection sampling keeps the model's own distribution."""

    method: Literal["none", "ngram", "mlp"] = option(
        "none", "Drafter: none (plain decoding); ngram (prompt lookup: the tokens that followed the latest earlier "
        "occurrence of the row's last n-gram, prompt and output; no draft model); or mlp (a small draft model on the "
        "policy's last hidden state, sharing its embeddings and head, trained online on the engine's own samples: "
        "noria.engine.drafter). A CPU engine's option for now: on CUDA a verify step runs eagerly beside "
        "graph-captured decode steps, 0.07x at batch 1 on an H100 (docs/engines.md), so policy: measured decodes "
        "plainly there after measuring it."
    )
    num_tokens: int = option(4, "Draft tokens proposed per verify step (k); a verify step computes k + 1 tokens.")
    ngram_max: int = option(3, "Longest n-gram looked up (tried first).")
    ngram_min: int = option(1, "Shortest n-gram looked up.")
    max_batch: int = option(
        8, "Speculation runs only while at most this many requests decode together; above it every row decodes "
        "plainly (a verify step multiplies a row's tokens by up to num_tokens + 1). 8: on a 2-core AMD EPYC (Zen 4), "
        "tiny-llama on copied tool output at temperature 1 ran 1.48x at batch 1 and 1.04x at batch 4 with "
        "speculation, 0.76x at 16 and 0.59x at 64 with it always on (noria bench spec, docs/engines.md)."
    )
    policy: Literal["measured", "always"] = option(
        "measured", "Within max_batch: measured speculates a step only when the rows' expected tokens per step (1 + "
        "each request's own moving average of drafts accepted per speculating step; 1 before it first speculated) "
        "exceed the cost of a speculating step over a plain one, measured on this engine per batch size (1, 2, 3-4, "
        "5-8, ...) in stretches of 8 steps of each kind; always: every step within max_batch speculates (and "
        "min_acceptance applies)."
    )
    draft_budget: int = option(
        16, "Draft tokens one step verifies at most, over all its rows (a verify step computes them beside its rows' own "
        "tokens). 16: on a 2-core AMD EPYC (Zen 4), a SmolLM2-135M forward of 1 to 16 tokens took the same 22-25 ms, "
        "of 32 tokens 29 ms and of 64 tokens 43 ms, so up to 16 drafted tokens cost a step almost nothing."
    )
    min_acceptance: float = option(
        0.1, "policy: always: fall back to plain decoding while the share of drafted tokens accepted, over the last "
        "window of at least 64 drafted tokens, is below this; speculation is tried again after the drafter's next "
        "training round, the next weight update or 512 steps. 0: never fall back. 0.1 is about break-even for k = 4 on "
        "the CPU (a verify step of 5 tokens costs 1.2-1.4 decode steps at batch 1; docs/engines.md). policy: measured "
        "weighs each request's own acceptance against the measured cost instead, and ignores this."
    )
    model_path: str | None = option(
        None, "mlp: a drafter saved by an earlier run (drafter.pt of a checkpoint or run folder) to start from; null: "
        "start untrained (no drafts until the first training round). Refused when its vocabulary or hidden size "
        "differs from the policy's."
    )
    online_training: bool = option(
        True, "mlp: train the drafter on the engine's own samples (the served model's hidden states and tokens), "
        "between steps while the engine has no request; off: serve model_path as it is."
    )
    draft_vocab: int = option(
        2048, "mlp: the drafter proposes only the most frequent tokens of the engine's samples, this many (its head is "
        "those rows of the policy's head: 2048 of SmolLM2's 49,152 make a draft token cost ~2% of a forward)."
    )
    draft_confidence: float = option(
        0.2, "mlp: a draft ends before the first token at which the product of the drafter's probabilities so far "
        "falls below this (its own estimate that the draft is accepted that far); 0: always num_tokens."
    )
    train_every_tokens: int = option(1024, "mlp: a training round starts once this many new sampled tokens were collected.")
    train_steps: int = option(8, "mlp: optimizer steps per training round (one per idle slice of the engine loop).")
    train_batch: int = option(256, "mlp: positions per optimizer step (each trains all num_tokens draft stages).")
    lr: float = option(2e-3, "mlp: the drafter's AdamW learning rate.")
    buffer_tokens: int = option(16384, "mlp: sampled tokens kept for training (the newest; older ones are dropped).")

    def validate(self) -> None:
        if not 0 <= self.draft_confidence < 1:
            raise ConfigError(f"engine.speculative.draft_confidence must be in [0, 1), got {self.draft_confidence}")
        if not 0 <= self.min_acceptance < 1:
            raise ConfigError(f"engine.speculative.min_acceptance must be in [0, 1), got {self.min_acceptance}")
        for key in ("draft_budget", "draft_vocab", "train_every_tokens", "train_steps", "train_batch", "buffer_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"engine.speculative.{key} must be >= 1, got {getattr(self, key)}")
        if self.lr <= 0:
            raise ConfigError(f"engine.speculative.lr must be > 0, got {self.lr}")
        if self.model_path is not None and self.method != "mlp":
            raise ConfigError(f"engine.speculative.model_path is the mlp drafter's; method is {self.method!r}: set method: mlp")
        if self.method == "mlp" and not self.online_training and self.model_path is None:
            raise ConfigError(
                "engine.speculative.method=mlp with online_training off needs a trained drafter: set "
                "engine.speculative.model_path, or online_training: true"
            )
        for key in ("num_tokens", "ngram_max", "ngram_min", "max_batch"):
            if getattr(self, key) < 1:
                raise ConfigError(f"engine.speculative.{key} must be >= 1, got {getattr(self, key)}")
        if self.ngram_min > self.ngram_max:
            raise ConfigError(
                f"engine.speculative.ngram_min ({self.ngram_min}) must not exceed engine.speculative.ngram_max "
                f"({self.ngram_max})"
            )
        if self.num_tokens > 32:
            raise ConfigError(f"engine.speculative.num_tokens must be <= 32, got {self.num_tokens}")


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
    kv_job_tokens: int | None = option(
        None,
        "KV tokens the job can use at once; with kv_cache_tokens null the cache gets the smaller of this and "
        "kv_memory_fraction's share. noria train fills it in for RL (job_kv_tokens: sequences generating together x "
        "the longest prompt + answer); null: no bound.",
    )
    max_context: int | None = option(None, "Longest prompt + output in tokens; null uses the model's max positions.")
    prefix_cache: bool = option(True, "Reuse KV blocks of shared prompt prefixes (radix tree, LRU eviction).")
    prefix_cache_share: float = option(
        0.25,
        "CPU: the share of the KV cache's blocks the prefix cache holds before a request that would write a block "
        "never written since the cache was allocated takes the prefix cache's least recently used block instead. The "
        "CPU cache is mapped lazily (a block costs memory once written), so resident KV memory stays near what runs "
        "plus this share. 1.0: the whole cache, as on GPU (allocated at start).",
    )
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
    quantization: Literal["none", "fp8", "int8", "int4"] = option(
        "none", "Rollout weights: none (the model dtype); fp8 (e4m3 decoder-block linears, per-channel weight and "
        "per-row activation scales; bf16 models; CUDA for speed); int8 (CPU: weight-only, one scale per output "
        "channel) or int4 (CPU: weight-only, a scale and offset per 32 input channels). Quantized weights are "
        "re-made at every weight update; pair them with train.loss.off_policy: tis."
    )
    lora_max_adapters: int = option(
        8, "LoRA adapters served at once (slots; a request names one, or none for the base model). Loading one more "
        "evicts the least recently used adapter that no request is using; with every slot in use the load is refused. "
        "Each slot holds rank x (in + out) values per targeted layer, in the model's dtype (docs/engines.md, Serving "
        "many LoRA adapters)."
    )
    lora_max_memory_mb: float | None = option(
        None, "Memory the LoRA slots may take at most, in MB (every targeted layer's stacks: lora_max_adapters x the "
        "largest rank x (in + out) values in the model's dtype); a load that would grow them past it is refused. "
        "null: no bound beyond lora_max_adapters."
    )
    speculative: SpeculativeConfig = option(
        factory=SpeculativeConfig, help="Speculative decoding (off by default; see docs/engines.md)."
    )
    onednn_cache_capacity: int | None = option(
        64,
        "CPU: entries of oneDNN's primitive cache and ideep's matmul cache in a noria serve process (as "
        "train.onednn_cache_capacity for noria train, whose value its engines inherit). Each new matmul shape caches a "
        "compiled kernel: with the defaults (1024 each) an engine's RSS grew 393 -> 656 MB over 600 batches of mixed "
        "sizes, with 64 it stayed at 433 MB at the same speed. null: the defaults; a value in the environment wins.",
    )

    def validate(self) -> None:
        if self.onednn_cache_capacity is not None and self.onednn_cache_capacity < 1:
            raise ConfigError(f"engine.onednn_cache_capacity must be >= 1 or null, got {self.onednn_cache_capacity}")
        for key in ("max_running_requests", "max_batch_tokens", "chunked_prefill_size", "block_size", "lora_max_adapters"):
            if getattr(self, key) < 1:
                raise ConfigError(f"engine.{key} must be >= 1, got {getattr(self, key)}")
        if self.lora_max_memory_mb is not None and self.lora_max_memory_mb <= 0:
            raise ConfigError(f"engine.lora_max_memory_mb must be > 0 or null, got {self.lora_max_memory_mb}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ConfigError(f"engine.kv_cache_tokens must be >= engine.block_size, got {self.kv_cache_tokens}")
        if self.kv_job_tokens is not None and self.kv_job_tokens < self.block_size:
            raise ConfigError(f"engine.kv_job_tokens must be >= engine.block_size, got {self.kv_job_tokens}")
        if not 0 <= self.prefix_cache_share <= 1:
            raise ConfigError(f"engine.prefix_cache_share must be in [0, 1], got {self.prefix_cache_share}")
        if not 0 < self.kv_memory_fraction <= 0.95:
            raise ConfigError(f"engine.kv_memory_fraction must be in (0, 0.95], got {self.kv_memory_fraction}")
        if self.chunked_prefill_size > self.max_batch_tokens:
            raise ConfigError("engine.chunked_prefill_size must not exceed engine.max_batch_tokens")
        if self.quantization == "fp8" and self.deterministic:
            raise ConfigError(
                "engine.quantization=fp8 cannot be combined with engine.deterministic (deterministic mode runs the "
                "trainer's own numerics; int8 and int4 can, with train.qat in the trainer); use engine.quantization: none"
            )
        self.speculative.validate()
        if self.speculative.method != "none" and self.speculative.num_tokens + 1 > self.max_batch_tokens:
            raise ConfigError(
                f"engine.speculative.num_tokens + 1 ({self.speculative.num_tokens + 1}) must not exceed "
                f"engine.max_batch_tokens ({self.max_batch_tokens}): a verify step computes both"
            )

    def check_model(self, device: str, impl: str, rollout_engine: str = "noria") -> None:
        """The rules between this section and the model's: int8 and int4 are CPU kernels of the
        built-in engine (``model.device`` and ``model.impl`` are the model section's keys); and
        speculative decoding needs the built-in engine's native model (``rollout.engine`` noria)."""
        if self.speculative.method != "none" and rollout_engine != "noria":
            raise ConfigError(
                f"engine.speculative.method={self.speculative.method} is the built-in engine's; rollout.engine="
                f"{rollout_engine} serves elsewhere (configure speculation on that server): use rollout.engine: noria "
                "or engine.speculative.method: none"
            )
        if self.speculative.method != "none" and impl == "hf":
            raise ConfigError(
                f"engine.speculative.method={self.speculative.method} needs the built-in engine's native model; "
                "model.impl=hf serves with the generic transformers engine, which has no speculative decoding: "
                "use model.impl: native or engine.speculative.method: none"
            )
        if self.quantization not in CPU_QUANTIZATIONS:
            return
        if device != "cpu":
            raise ConfigError(
                f"engine.quantization={self.quantization} runs on CPU only (model.device is {device}); supported on "
                "CUDA: none, fp8"
            )
        if impl == "hf":
            raise ConfigError(
                f"engine.quantization={self.quantization} needs the built-in engine's native model; model.impl=hf "
                "serves with the generic transformers engine, which supports engine.quantization: none only"
            )


CPU_QUANTIZATIONS = ("int8", "int4")
"""Values of ``engine.quantization`` served by CPU kernels only."""


def job_kv_tokens(config: Any) -> int | None:
    """The KV tokens an RL run's engine can use at once (``engine.kv_job_tokens``), from its config:
    the most sequences generating together (the rollout's places, ``rollout.max_in_flight`` or
    ``prompts_per_step * n_samples``, or one evaluation batch, ``eval.batch_size * eval.n_samples``;
    at most ``engine.max_running_requests``) times the longest of them (``data.max_prompt_tokens``
    plus the longer of ``rollout.max_new_tokens`` and ``eval.max_new_tokens``, and one block for the
    partly filled last one). Prompts shared by a group are counted once per sample, so this is an
    upper bound. None where the config does not bound it: no ``data.max_prompt_tokens``, or a
    rollout, generate or agent function (multi-turn contexts)."""
    r, e = config.rollout, config.engine
    if config.data.max_prompt_tokens is None or any(getattr(r, k) for k in ("rollout_fn", "generate_fn", "agent_fn")):
        return None
    rollout = r.max_in_flight or (r.prompts_per_step or 8) * r.n_samples
    evaluation = config.eval.batch_size * config.eval.n_samples
    sequences = min(max(rollout, evaluation), e.max_running_requests)
    longest = config.data.max_prompt_tokens + max(r.max_new_tokens, config.eval.max_new_tokens) + e.block_size
    return sequences * longest
