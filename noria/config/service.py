"""The config of ``noria service``: the base model and the ``service`` section (tenants, quotas,
saved state). Owner: ``noria.service``. Not part of ``RunConfig``: the service is its own process,
configured by ``--model.*``, ``--service.*`` and ``--engine.*`` overrides (or a YAML file with those two sections).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from noria.config.engine import EngineConfig
from noria.config.model import ModelConfig
from noria.config.schema import ConfigError, option


@dataclass
class ServiceSection:
    """Tenants, their default quotas, the LoRA defaults and where saved states live. Owner: ``noria.service``."""

    keys_file: str = option(
        "",
        "YAML or JSON file of tenants: {tenants: {NAME: {key: KEY, max_adapters: N, tokens_per_minute: N, "
        "queue_depth: N}}} (quotas optional, the defaults below otherwise). Empty: one tenant, 'default', "
        "with a key generated and printed at start.",
    )
    state_dir: str = option(
        "service-state", "Folder of saved states and sampler weights, one subfolder per tenant (tinker:// paths point here)."
    )
    max_adapters: int = option(4, "Default quota: LoRA adapters (training clients) a tenant may hold at once.")
    tokens_per_minute: int = option(
        200_000, "Default quota: tokens (forward_backward inputs and sampled tokens) a tenant may send in any 60 s."
    )
    queue_depth: int = option(16, "Default quota: a tenant's calls waiting or running at once; one more is answered 429.")
    batch_tokens: int = option(
        16384, "forward / forward_backward calls of different tenants waiting at once run together (each row with its "
        "own adapter) up to this many tokens in all; 1 runs every call alone.",
    )
    micro_batch_tokens: int = option(
        2048, "Padded tokens (rows x the longest row) through the model at once: calls run together, and one large "
        "call, go through in micro-batches of at most this many, so the activations a step holds stay bounded "
        "(SmolLM2-135M in fp32, rank-16 adapters on every projection: peak 8.0 GB at 2048 against 17.3 GB for 48 rows "
        "of about 85 tokens in one forward); a row longer than this gets one of its own.",
    )
    activation_checkpointing: bool = option(
        False, "Recompute each decoder layer's activations in the backward of forward_backward rather than keep them: "
        "less memory, more compute (SmolLM2-135M in fp32, rank-16 adapters on every projection, four tenants' calls of "
        "24 rows at micro_batch_tokens 4096 on a 2-core AMD EPYC Zen 3: peak RSS 14.1 -> 8.7 GB, 1.15-1.5x the time).",
    )
    logprob_chunk_tokens: int | None = option(
        1024, "Tokens whose logits are computed at once (the LM head applied in chunks, each recomputed in backward, as "
        "train.logprob_chunk_tokens does): bounds the [tokens, vocabulary] logits a call holds. null: all of a "
        "micro-batch's at once.",
    )
    max_rank: int = option(64, "Largest LoRA rank a training client may ask for.")
    lora_alpha: float = option(32.0, "LoRA alpha of every adapter (peft scales B @ A by alpha / rank).")
    sampler: bool = option(
        True, "Start the built-in engine beside the trainer for sample (its own copy of the base model; the engine "
        "section configures it). false: training only, sample is refused.",
    )
    placement: Literal["colocated", "disaggregated"] = option(
        "colocated", "Where the sampling engine runs. colocated: in the service's process, on its own copy of the base "
        "model. disaggregated: in its own `noria serve` process, started by the service on a free loopback port (its log "
        "in state_dir/engine.log), or the server at engine_url; each adapter version reaches it as a peft folder written "
        "under state_dir, so the engine must see that folder.",
    )
    engine_url: str | None = option(
        None, "placement disaggregated: base URL of a running `noria serve` of the same base model, with LoRA slots "
        "(engine.lora_max_adapters) and no API key, on this machine or a shared file system; null starts one.",
    )
    seed: int = option(0, "Seed of each adapter's initialisation (with the adapter's own seed added).")

    def validate(self) -> None:
        for key in ("max_adapters", "tokens_per_minute", "queue_depth", "max_rank", "batch_tokens", "micro_batch_tokens", "logprob_chunk_tokens"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"service.{key} must be >= 1, got {getattr(self, key)}")
        if self.lora_alpha <= 0:
            raise ConfigError(f"service.lora_alpha must be > 0, got {self.lora_alpha}")
        if self.placement == "disaggregated" and not self.sampler:
            raise ConfigError("service.placement: disaggregated places the sampling engine: it needs service.sampler: true")
        if self.engine_url is not None and self.placement != "disaggregated":
            raise ConfigError("service.engine_url names an engine of its own process: it needs service.placement: disaggregated")


@dataclass
class ServiceConfig:
    """What ``noria service`` reads: the frozen base model, the ``service`` section and the sampling engine."""

    model: ModelConfig = option(factory=ModelConfig, help="The frozen base model every adapter sits on.")
    service: ServiceSection = option(factory=ServiceSection, help="Tenants, quotas, LoRA defaults, saved state.")
    engine: EngineConfig = option(factory=EngineConfig, help="The built-in engine that samples (service.sampler).")

    def validate(self) -> None:
        self.model.validate()
        self.service.validate()
        self.engine.validate()

    def resolve(self) -> None:
        """``model.dtype: auto`` becomes this machine's dtype (``ModelConfig.resolve_dtype``)."""
        self.model.resolve_dtype()
