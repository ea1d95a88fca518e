"""Many LoRA adapters on one frozen base model, each with its own optimizer.

``MultiLora`` owns the base model (loaded once, every base parameter frozen) and injects one peft
LoRA adapter per training client (``peft.inject_adapter_in_model`` under the adapter's own name,
as ``noria.train.lora.apply_lora`` does for the single adapter of a run). Each ``Adapter`` holds:

- its parameters only (``...lora_A.<name>.weight`` / ``lora_B``), in a fixed (sorted) order;
- a torch ``AdamW`` over exactly those parameters, so an optimizer step can touch no other adapter;
- its spec (rank, alpha, target modules, seed) and the count of optimizer steps applied.

``per_row(names)`` gives each row of a batch its own adapter (peft's mixed-batch forward: the base matmuls run once
for the whole batch, each adapter's LoRA matmuls on its own rows), so one forward serves several
tenants; rows never mix in a causal LM, so each adapter's gradient comes from its own rows only. Only the service's worker
thread calls into this module, one call at a time: nothing here locks.

Not supported: peft's DoRA and dropout (adapters are made with dropout 0, so a forward is
deterministic for a given adapter state).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from noria.errors import NoriaError


@dataclass(frozen=True)
class AdapterSpec:
    """What a training client asked for: rank, alpha, the linear layers adapted, the init seed."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    seed: int


@dataclass
class Adapter:
    """One tenant's LoRA adapter: parameters, optimizer, spec and counters."""

    name: str
    tenant: str
    spec: AdapterSpec
    params: dict[str, nn.Parameter]
    optimizer: torch.optim.AdamW
    steps: int = 0
    """Optimizer steps applied."""
    version: int = 0
    """Grows whenever the weights change (optim_step, load_state): the engine's copy is named by it."""
    grad_calls: int = 0
    """forward_backward calls whose gradient waits for the next optimizer step."""
    meta: dict = field(default_factory=dict)


ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class MultiLora:
    """The frozen base model and its adapters by name."""

    def __init__(self, model: nn.Module, model_path: str, checkpointing: bool = False, chunk_tokens: int | None = None) -> None:
        self.model = model
        self.model_path = model_path
        self.chunk_tokens = chunk_tokens
        """Tokens per chunk of the LM head in ``noria.service.step.target_logprobs``; None: all at once."""
        for p in model.parameters():
            p.requires_grad_(False)
        model.eval()  # no dropout anywhere: the service's forwards are deterministic
        if checkpointing:  # each decoder layer's activations recomputed in backward (inside ``per_row``)
            from noria.train.fsdp import checkpoint_layer, decoder_layers

            for layer in decoder_layers(model):
                checkpoint_layer(layer)
        self.adapters: dict[str, Adapter] = {}

    @classmethod
    def load(cls, path: str, dtype: str, device: str, checkpointing: bool = False, chunk_tokens: int | None = None) -> MultiLora:
        """The base model of an HF folder, in ``dtype`` on ``device``; ``checkpointing``: each decoder
        layer's activations recomputed in backward rather than kept; ``chunk_tokens``: the LM head
        applied that many tokens at a time."""
        from transformers import AutoModelForCausalLM

        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device)
        return cls(model, path, checkpointing, chunk_tokens)

    def chunked_head(self) -> tuple[nn.Module, nn.Module] | None:
        """(the decoder body, the LM head) when logprobs may be taken in chunks: ``chunk_tokens`` is set
        and the model's logits are the head applied to the body's last hidden state (no scaling or
        soft-capping between them, as in Llama, Qwen and Mistral); None otherwise."""
        cfg = self.model.config
        body, head = getattr(self.model, "model", None), self.model.get_output_embeddings()
        plain = not any(getattr(cfg, key, None) not in (None, 1.0) for key in ("final_logit_softcapping", "logit_scale"))
        if self.chunk_tokens is None or body is None or head is None or not plain:
            return None
        return body, head

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def add(self, name: str, tenant: str, spec: AdapterSpec) -> Adapter:
        """Inject a fresh adapter (B = 0, so it starts as the base model) with its own AdamW."""
        from peft import LoraConfig as PeftLoraConfig
        from peft import inject_adapter_in_model

        if name in self.adapters:
            raise NoriaError(f"adapter {name} exists")
        cfg = PeftLoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, target_modules=list(spec.target_modules))
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*peft_config.*")  # several adapters is the point here
            torch.manual_seed(spec.seed)
            try:
                inject_adapter_in_model(cfg, self.model, adapter_name=name)
            except ValueError as e:  # peft: no module matched the targets, and the like
                raise NoriaError(f"lora_config.target_modules {list(spec.target_modules)}: {e}") from None
        params = {n: p for n, p in sorted(self.model.named_parameters()) if _owner(n) == name}
        if not params:
            self._drop(name)
            raise NoriaError(f"target modules {list(spec.target_modules)} matched no linear layer of {self.model_path}")
        for p in params.values():
            p.requires_grad_(True)
        optimizer = torch.optim.AdamW(list(params.values()), lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        adapter = self.adapters[name] = Adapter(name=name, tenant=tenant, spec=spec, params=params, optimizer=optimizer)
        return adapter

    @contextlib.contextmanager
    def per_row(self, names: list[str | None]) -> Iterator[None]:
        """Within: each batch row ``i`` of a forward runs with adapter ``names[i]`` (None: the base
        alone), through peft's mixed-batch LoRA forward; every named adapter takes gradients."""
        from functools import partial

        from peft.tuners.tuners_utils import BaseTunerLayer

        rows = [n if n is not None else "__base__" for n in names]
        for adapter in self.adapters.values():
            for p in adapter.params.values():
                p.requires_grad_(adapter.name in rows)
        hooks = [
            m.register_forward_pre_hook(partial(_inject_rows, rows=rows), with_kwargs=True)
            for m in self.model.modules() if isinstance(m, BaseTunerLayer)
        ]  # fmt: skip
        try:
            yield
        finally:
            for h in hooks:
                h.remove()

    def remove(self, name: str) -> None:
        """Take an adapter out of the model; its parameters and optimizer state are dropped."""
        self.adapters.pop(name)
        self._drop(name)

    def _drop(self, name: str) -> None:
        from peft.functional import delete_adapter

        delete_adapter(self.model, name, prefix="lora_")
        getattr(self.model, "peft_config", {}).pop(name, None)

    def peft_tensors(self, adapter: Adapter):
        """The adapter's tensors named as ``noria.train.lora`` streams them (``.lora_A.default.weight``),
        so its ``save_adapter`` writes the peft folder."""
        from noria.train.lora import ADAPTER

        for n, p in adapter.params.items():
            yield n.replace(f".{adapter.name}.", f".{ADAPTER}."), p.detach()

    def save_peft(self, adapter: Adapter, folder: Path) -> Path:
        """The adapter as a peft folder (``adapter_config.json`` + ``adapter_model.safetensors``)."""
        from noria.config import LoraConfig
        from noria.train.lora import save_adapter

        cfg = LoraConfig(enabled=True, rank=adapter.spec.rank, alpha=adapter.spec.alpha, target_modules=list(adapter.spec.target_modules))
        return save_adapter(self.peft_tensors(adapter), cfg, folder, self.model_path)


def _inject_rows(module: nn.Module, args: tuple, kwargs: dict, rows: list[str]) -> tuple[tuple, dict]:
    """peft's mixed-batch argument, added to a LoRA layer's forward (as peft's own hook does)."""
    return args, {**kwargs, "adapter_names": rows}


def _owner(param_name: str) -> str | None:
    """The adapter a parameter belongs to (``...lora_A.<name>.weight``), else None."""
    parts = param_name.split(".")
    for i, part in enumerate(parts[:-2]):
        if part in ("lora_A", "lora_B"):
            return parts[i + 1]
    return None


def target_modules(lora_config: dict) -> tuple[str, ...]:
    """The linear layers a Tinker ``lora_config`` adapts: ``target_modules`` if given, else
    attention and MLP projections by ``train_attn`` / ``train_mlp`` (both on by default, as Tinker's)."""
    if lora_config.get("target_modules"):
        mods = lora_config["target_modules"]
        if not isinstance(mods, list) or not all(isinstance(m, str) and m for m in mods):
            raise NoriaError(f"lora_config.target_modules: a list of module names, got {mods!r}")
        return tuple(mods)
    if lora_config.get("train_unembed"):
        raise NoriaError("lora_config.train_unembed: adapting the unembedding is not supported")
    mods = (ATTN if lora_config.get("train_attn", True) else ()) + (MLP if lora_config.get("train_mlp", True) else ())
    if not mods:
        raise NoriaError("lora_config: train_attn and train_mlp are both false: nothing to adapt")
    return mods
