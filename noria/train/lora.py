"""LoRA adapters through peft: inject, and turn adapted weights back into HF tensors.

``apply_lora`` injects peft LoRA layers into the policy in place (``inject_adapter_in_model``):
the model keeps its class and its ``forward`` / ``hidden_states``; every targeted ``nn.Linear``
becomes a peft ``lora.Linear`` whose frozen weight sits under ``.base_layer`` and whose adapters
are ``lora_A.default`` / ``lora_B.default``. Only adapter parameters require grad, so only they
reach the optimizer (``build_optimizer`` keeps trainable parameters).

Weights leave the trainer in one of two forms (``train.lora.sync``):

- ``merged``: ``merge_lora`` turns the stream of (name, full tensor) pairs back into HF names with
  ``W + scaling * B @ A`` folded in, so an engine loads them as a plain checkpoint (also what
  ``export_hf`` writes);
- ``adapter``: ``adapter_tensors`` keeps only the adapters, with peft's saved names
  (``base_model.model.<module>.lora_A.weight``) for engines that load LoRA adapters.

The merge is computed in fp32 and then cast, so merged weights round once. Not supported: peft's
DoRA, rsLoRA scaling, and dropout > 0 with bitwise-reproducible resumes (dropout draws RNG).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from noria.config import LoraConfig

ADAPTER = "default"
_BASE = ".base_layer."
_A = f".lora_A.{ADAPTER}.weight"
_B = f".lora_B.{ADAPTER}.weight"


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place; every other parameter is frozen."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    peft_cfg = PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules)
    )
    model = inject_adapter_in_model(peft_cfg, model, adapter_name=ADAPTER)
    if not any(_A in name for name, _ in model.named_parameters()):
        raise ValueError(f"train.lora.target_modules {cfg.target_modules} matched no linear layer of the model")
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model


def merge_lora(
    tensors: Iterator[tuple[str, torch.Tensor]], scaling: float, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors with adapters folded into their base weights (``W + scaling * B @ A``).

    ``tensors`` is a state-dict-ordered stream in which each ``base_layer.weight`` precedes its
    ``lora_A`` and ``lora_B``; at most one layer's three tensors are held at a time.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        if name.endswith(_A) or name.endswith(_B):
            prefix = name[: -len(_A)]
            parts = pending[prefix]
            parts["A" if name.endswith(_A) else "B"] = t
            if len(parts) == 3:
                w, a, b = parts["W"].float(), parts["A"].float(), parts["B"].float()
                yield f"{prefix}.weight", (w + scaling * (b @ a)).to(dtype)
                del pending[prefix]
        elif name.endswith(_BASE + "weight"):
            pending[name[: -len(_BASE + "weight")]] = {"W": t}
        else:
            yield name.replace(_BASE, "."), t.to(dtype)
    if pending:
        raise RuntimeError(f"LoRA layers without both adapters in the stream: {sorted(pending)}")


def adapter_tensors(tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Only the adapters, named as peft saves them (``base_model.model.<module>.lora_A.weight``)."""
    for name, t in tensors:
        if name.endswith(_A) or name.endswith(_B):
            yield "base_model.model." + name.replace(f".{ADAPTER}.", "."), t.to(dtype)


def lora_scaling(cfg: LoraConfig) -> float:
    """alpha / r, the factor peft applies to ``B @ A``."""
    return cfg.alpha / cfg.rank
