"""The ``log`` section: metric sinks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from noria.config.schema import ConfigError, option


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
