"""The diffusion engine's request and response records, and their JSON form (``POST /generate_image``).

``ImageRequest`` asks for one image of one class: its seed fixes the initial noise and every
step's noise (bit for bit on one device and dtype), ``steps``/``noise_level``/``shift`` the
sampler (``noise_level`` 0: the ODE). ``ImageOutput`` holds the whole trajectory: the T+1 latents
(x_T noise first, x_0 last), the log-probability of each of the T transitions, and the weight
version that computed each step (a weight update between two steps of a request shows here).

JSON: latents travel as base64 of their raw little-endian float32 bytes with their shape (exact,
unlike decimal text); unknown request fields are refused with a ``RequestError`` naming them.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from noria.engine.protocol import RequestError

MAX_STEPS = 1000


@dataclass(frozen=True)
class ImageRequest:
    """One image to generate."""

    label: int
    """Class condition (0 .. num_classes - 1)."""
    seed: int
    """Seed of this image's noise: the same request with the same seed gives the same image."""
    steps: int = 10
    """Denoising steps T."""
    noise_level: float = 0.7
    """SDE noise level a (0: the deterministic ODE, log-probabilities 0)."""
    shift: float = 1.0
    """Timestep shift of the schedule."""
    rid: str = ""
    """Request id (the engine makes one when empty)."""

    def validate(self, num_classes: int | None = None) -> None:
        """Raise ``RequestError`` naming the first bad field."""
        for name in ("label", "seed", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise RequestError(f"{name} must be an integer, got {value!r}")
        if num_classes is not None and not 0 <= self.label < num_classes:
            raise RequestError(f"label must be in [0, {num_classes}), got {self.label}")
        if not -(2**63) <= self.seed < 2**63:
            raise RequestError(f"seed must be a 64-bit integer, got {self.seed}")
        if not 1 <= self.steps <= MAX_STEPS:
            raise RequestError(f"steps must be in [1, {MAX_STEPS}], got {self.steps}")
        for name in ("noise_level", "shift"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RequestError(f"{name} must be a finite number, got {value!r}")
        if self.noise_level < 0 or self.shift <= 0:
            raise RequestError(f"noise_level must be >= 0 and shift > 0, got {self.noise_level}, {self.shift}")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Any) -> ImageRequest:
        if not isinstance(data, dict):
            raise RequestError(f"an image request must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RequestError(f"unknown field(s) {unknown}; known: {sorted(known)}")
        if "label" not in data or "seed" not in data:
            raise RequestError("an image request needs label and seed")
        req = cls(**data)
        req.validate()
        return req


@dataclass
class ImageOutput:
    """A finished (or aborted) image request."""

    rid: str
    latents: torch.Tensor | None
    """float32 [T+1, C, H, W] on the CPU: x at every noise level, noise first; None if aborted."""
    logprobs: list[float] = field(default_factory=list)
    """[T]: log-probability of each transition (mean over latent dimensions; 0 for ODE steps)."""
    weight_versions: list[int] = field(default_factory=list)
    """[T]: weight version that computed each step."""
    finish_reason: dict[str, Any] = field(default_factory=lambda: {"type": "stop"})
    """``{"type": "stop"}``, or ``{"type": "abort", "message": ...}``."""

    @property
    def finished_ok(self) -> bool:
        return self.finish_reason.get("type") == "stop"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rid": self.rid, "logprobs": list(self.logprobs),
                               "weight_versions": list(self.weight_versions), "finish_reason": self.finish_reason}  # fmt: skip
        if self.latents is not None:
            data = self.latents.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
            out["latents"] = {"shape": list(self.latents.shape), "data": base64.b64encode(data).decode()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ImageOutput:
        latents = None
        if data.get("latents") is not None:
            raw = base64.b64decode(data["latents"]["data"])
            latents = torch.from_numpy(np.frombuffer(raw, dtype="<f4").copy()).view(*data["latents"]["shape"])
        return cls(str(data["rid"]), latents, [float(x) for x in data["logprobs"]],
                   [int(v) for v in data["weight_versions"]], dict(data["finish_reason"]))  # fmt: skip
