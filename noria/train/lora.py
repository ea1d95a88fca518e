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

An adapter folder in peft's own format is written by ``save_adapter`` (the final export's
``adapter/``) and read by ``load_adapter`` (``train.lora.adapter_path``: a run starts from it).

The merge is computed in fp32 and then cast, so merged weights round once. Not supported: peft's
DoRA, rsLoRA scaling, and dropout > 0 with bitwise-reproducible resumes (dropout draws RNG).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from noria.config import LoraConfig

ADAPTER = "default"
_BASE = ".base_layer."
_A = f".lora_A.{ADAPTER}.weight"
_B = f".lora_B.{ADAPTER}.weight"


LM_ONLY = r".*\.(vision_model|connector)\..*"
"""Modules a vision-language model's adapters leave out unless ``train.lora.vision`` (its vision tower
and connector: their attention and MLP layers share the language model's names)."""


def excluded(cfg: LoraConfig, vision_language: bool) -> str | None:
    """peft's ``exclude_modules`` for a model: a vision-language model's tower and connector unless
    ``train.lora.vision``; None for a text model."""
    return LM_ONLY if vision_language and not getattr(cfg, "vision", False) else None


def _has_vision(base: str) -> bool:
    config = Path(base) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place; every other parameter is frozen."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    peft_cfg = PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules),
        exclude_modules=excluded(cfg, any(n.split(".")[-1] == "vision_model" for n, _ in model.named_modules())),
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


ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""The file peft writes and reads an adapter's tensors from (beside ``adapter_config.json``)."""


def save_adapter(tensors: Iterator[tuple[str, torch.Tensor]], cfg: LoraConfig, folder: Path, base: str) -> Path:
    """The adapters alone as a peft folder (``adapter_config.json`` + ``adapter_model.safetensors``),
    loadable by ``peft.PeftModel.from_pretrained(base_model, folder)`` and by engines that take LoRA."""
    from peft import LoraConfig as PeftLoraConfig
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    peft_cfg = PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules),
        exclude_modules=excluded(cfg, _has_vision(base)), base_model_name_or_path=base, task_type="CAUSAL_LM",
    )  # fmt: skip
    peft_cfg.save_pretrained(str(folder))
    save_file({n: t.contiguous() for n, t in adapter_tensors(tensors, torch.float32)}, str(folder / ADAPTER_WEIGHTS))
    return folder


def load_adapter(model: nn.Module, folder: str | Path, cfg: LoraConfig) -> None:
    """Start the injected adapters from an existing peft adapter folder (``train.lora.adapter_path``);
    its rank, alpha and target modules must be the config's, and it must hold every adapter."""

    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "adapter_config.json").is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"train.lora.adapter_path {folder}: needs adapter_config.json and {ADAPTER_WEIGHTS} (a peft adapter folder)")
    saved = json.loads((folder / "adapter_config.json").read_text())
    want = {"r": cfg.rank, "lora_alpha": cfg.alpha, "target_modules": sorted(cfg.target_modules)}
    have = {"r": saved.get("r"), "lora_alpha": saved.get("lora_alpha"), "target_modules": sorted(saved.get("target_modules") or [])}
    if have != want:
        raise ValueError(f"train.lora.adapter_path {folder}: the adapter has {have}, train.lora asks for {want}")
    state = {_ours(n): t for n, t in load_file(str(folder / ADAPTER_WEIGHTS)).items()}
    adapters = {n for n, _ in model.named_parameters() if n.endswith(_A) or n.endswith(_B)}
    if set(state) != adapters:
        missing, extra = sorted(adapters - set(state)), sorted(set(state) - adapters)
        raise ValueError(f"train.lora.adapter_path {folder}: adapters missing {missing[:3]}, unknown {extra[:3]}")
    model.load_state_dict(state, strict=False)


def _ours(peft_name: str) -> str:
    """peft's saved name (``base_model.model.<m>.lora_A.weight``) -> the injected parameter's name."""
    name = peft_name.removeprefix("base_model.model.")
    return name.replace(".lora_A.weight", _A).replace(".lora_B.weight", _B)
