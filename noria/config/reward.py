"""The ``reward`` section: the reward function by name or import path, and its limits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from noria.config.schema import ConfigError, option


@dataclass
class RewardConfig:
    """How a sample is scored. Owner: ``noria.rewards`` (the registry and the runner)."""

    name: str | None = option(
        None,
        "A registered reward (exact_match, numeric, math, format, countdown) or a user function: "
        "`pkg.module:fn`, or `path/to/file.py:fn` (imported from that file, its folder on sys.path); "
        "null uses the built-in task's own reward.",
    )
    kwargs: dict[str, Any] = option(factory=dict, help="Keyword arguments passed to the reward function.")
    timeout_s: float = option(10.0, "Seconds one reward call may take; past that the sample is marked failed.")
    max_concurrency: int = option(32, "Reward calls running at once (threads for sync functions).")

    def validate(self) -> None:
        if self.timeout_s <= 0:
            raise ConfigError(f"reward.timeout_s must be > 0, got {self.timeout_s}")
        if self.max_concurrency < 1:
            raise ConfigError(f"reward.max_concurrency must be >= 1, got {self.max_concurrency}")
