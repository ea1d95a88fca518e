"""Frozen parts of a vision-language policy (``train.freeze``): their parameters never take a
gradient, so the optimizer (``noria.train.optim.build_optimizer`` keeps trainable parameters) never
holds or moves them.

What this module owns: the names of a model's freezable parts (``PARTS``) and ``freeze_parts``.
LoRA (``noria.train.lora``) freezes every base weight anyway; ``train.freeze`` matters for full
fine-tuning, where a small vision tower trained by RL on a few thousand images may drift from what
its warm start taught it.

Failure: a part the model does not have (a text-only model) is a ``ValueError`` naming it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

PARTS = {"vision": "vision_model", "connector": "connector"}
"""``train.freeze`` names -> the submodule of the model's body (``noria.models.vlm.VisionBody``)."""


def freeze_parts(model: nn.Module, parts: Sequence[str]) -> int:
    """Turn off gradients of ``parts`` of ``model``; returns how many parameters were frozen."""
    frozen = 0
    body = getattr(model, "model", None)
    for part in parts:
        module = getattr(body, PARTS[part], None) if part in PARTS else None
        if not isinstance(module, nn.Module):
            raise ValueError(f"train.freeze: {part!r}: the model ({type(model).__name__}) has no such part; only vision-language models have {sorted(PARTS)}")
        for p in module.parameters():
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen
