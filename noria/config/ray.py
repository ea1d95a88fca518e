"""The ``ray`` config section: how the Ray launcher (``noria.launch.ray``) places a run's parts.

``launch: ray`` in a run config picks that launcher (``launch: local``, the default, runs every part
on this machine as processes). Owner: ``noria.launch.ray``; loading a config never imports Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from noria.config.schema import ConfigError, option


@dataclass
class RayConfig:
    """Where the Ray launcher places engines and trainer ranks. Owner: ``noria.launch.ray``."""

    address: str | None = option(
        None,
        "Ray cluster to join: `auto` (the cluster this machine belongs to) or `HOST:PORT` of its head; null starts a "
        "private Ray instance in this process, bound to 127.0.0.1, and stops it at the end of the run.",
    )
    engine_resources: dict[str, float] = option(
        factory=lambda: {"CPU": 1.0},
        help="Ray resources of one engine actor (its placement-group bundle), e.g. {CPU: 4, GPU: 1}; a fraction of a "
        "GPU lets engines share one. An engine with a GPU runs on the GPU Ray assigns it.",
    )
    trainer_resources: dict[str, float] = option(
        factory=lambda: {"CPU": 1.0},
        help="Ray resources of one trainer-rank actor (its bundle), e.g. {CPU: 8, GPU: 1}; with a GPU the rank trains "
        "on the GPU Ray assigns it (train.device must then be cuda).",
    )
    engine_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = option(
        "SPREAD", "Placement-group strategy of the engine pool (SPREAD: engines over as many nodes as possible)."
    )
    trainer_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = option(
        "PACK", "Placement-group strategy of the trainer pool (PACK: ranks on as few nodes as possible, near each other)."
    )
    ready_timeout_s: float = option(
        600.0, "Seconds the placement groups may wait for resources and an actor may take to start before the run stops."
    )

    def validate(self) -> None:
        for key in ("engine_resources", "trainer_resources"):
            resources = getattr(self, key)
            amounts = list(resources.values())
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in amounts):
                raise ConfigError(f"ray.{key}: every amount must be a number, got {resources}")
            if any(v < 0 for v in amounts) or not any(v > 0 for v in amounts):
                raise ConfigError(f"ray.{key} must name at least one resource with an amount > 0 and none < 0, got {resources}")
        if self.ready_timeout_s <= 0:
            raise ConfigError(f"ray.ready_timeout_s must be > 0, got {self.ready_timeout_s}")
