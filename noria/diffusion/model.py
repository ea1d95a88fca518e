"""The diffusion policy: diffusers' class-conditional DiT, its folders, and its exact-numerics mode.

The model is ``diffusers.DiTTransformer2DModel`` (patchified transformer, sincos positions,
timestep + class embeddings, adaLN-Zero blocks), used as a rectified-flow velocity predictor
(``noria.diffusion.sde``): ``velocity(model, x, sigma, labels)`` feeds it ``sigma * 1000`` as the
timestep. Latents are pixels here (the digits model has no VAE): ``to_image`` turns a final latent
in [-1, 1] into uint8. A model folder is what diffusers writes and reads (``config.json`` +
``diffusion_pytorch_model.safetensors``), so ``DiTTransformer2DModel.from_pretrained`` and
diffusers' ``DiTPipeline`` load what Noria saves. A folder holding only ``config.json`` is a
model to train from scratch (``load_dit(..., allow_new=True)``, seeded).

Class dropout: diffusers' label embedding drops a label (to the "null" class ``num_classes``) with
probability 0.1 in ``train()`` mode. Flow-matching SFT trains that way (the model learns the
unconditional velocity too); rollout and RL run the model in ``eval()`` mode, where nothing is
random, so the trainer recomputes what the engine computed.

Exact numerics (``set_exact_numerics``; the deterministic mode of engine and trainer): a sample's
bits must not depend on what else shares the batch. Per-row ops (LayerNorm without affine, GELU,
SiLU, the embeddings) are that already; matmuls and attention are not, so every ``nn.Linear``
(peft's LoRA layers included) and the patch-embedding convolution compute through
``noria.models.decoder.row_chunked_linear`` (matmuls of one fixed shape), and attention through
``noria.models.attention.exact_attention`` (an ``AttentionProcessor`` of diffusers' own kind). The
gradient of exact attention is SDPA's (recomputed), i.e. the gradient of the same function up to
rounding. Hand-written only where diffusers has no batch-invariant path.

Not guaranteed: rectangular images (diffusers' DiT unpatchifies squares), CFG (the class
conditioning is used as is), exact numerics on CUDA without Triton.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from noria.diffusion.sde import TIMESTEP_SCALE
from noria.errors import NoriaError

DIT_CLASS = "DiTTransformer2DModel"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"


class ModelFolderError(NoriaError):
    """A model folder is not a diffusers DiT folder; the message names the folder and what is wrong."""


# ------------------------------------------------------------------------------------- folders


def read_dit_config(path: str | Path) -> dict[str, Any]:
    """The DiT's ``config.json``; ``ModelFolderError`` when the folder is not a DiT folder."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise ModelFolderError(f"{path}: no {CONFIG_FILE} (expected a diffusers {DIT_CLASS} folder)")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ModelFolderError(f"{file}: not valid JSON: {e}") from e
    if config.get("_class_name") != DIT_CLASS:
        raise ModelFolderError(f"{file}: _class_name is {config.get('_class_name')!r}, expected {DIT_CLASS!r}")
    return config


def is_dit_folder(path: str | Path) -> bool:
    """Whether ``path`` holds a diffusers DiT config (what ``noria serve`` checks to pick the engine)."""
    try:
        read_dit_config(path)
    except ModelFolderError:
        return False
    return True


def has_weights(path: str | Path) -> bool:
    return (Path(path) / WEIGHTS_FILE).is_file()


def load_dit(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
             allow_new: bool = False, seed: int = 0) -> nn.Module:
    """The DiT in ``path`` in ``dtype`` on ``device``, in eval mode. A folder without weights is a
    new model (random init from ``seed``) only with ``allow_new``, else ``ModelFolderError``."""
    from diffusers import DiTTransformer2DModel

    config = read_dit_config(path)
    if has_weights(path):
        model = DiTTransformer2DModel.from_pretrained(str(path), torch_dtype=dtype)
    elif allow_new:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = DiTTransformer2DModel.from_config(config)
    else:
        raise ModelFolderError(f"{path}: no {WEIGHTS_FILE}; train it first (a config-only folder starts SFT from scratch)")
    return cast(model, device, dtype).eval()  # buffers too (sincos positions), as the trainer casts them


def cast(model: nn.Module, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> nn.Module:
    """``model`` moved and cast in place (parameters and buffers). Through ``nn.Module.to``: diffusers'
    override warns on every dtype cast about modules kept in float32, even when a model has none,
    as a DiT has none; a model that does keep some goes through diffusers' own ``to``."""
    if getattr(model, "_keep_in_fp32_modules", None):
        return model.to(device=device, dtype=dtype)
    return nn.Module.to(model, device=device, dtype=dtype)


def save_dit(model: nn.Module, folder: str | Path, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a diffusers folder of ``model``'s architecture holding ``state`` (default: its own
    weights); a model with peft adapters is written from a merged ``state`` by the caller."""
    from diffusers import DiTTransformer2DModel

    folder = Path(folder)
    target = model
    if state is not None:
        target = DiTTransformer2DModel.from_config(dict(model.config))
        target.load_state_dict(state, strict=True)
        target = cast(target, dtype=next(iter(state.values())).dtype)
    target.save_pretrained(str(folder), safe_serialization=True)
    return folder


def num_classes(model: nn.Module) -> int:
    """Class labels the model was trained on (the null class ``num_classes`` excluded)."""
    return int(model.config.num_embeds_ada_norm)


def latent_shape(model: nn.Module) -> tuple[int, int, int]:
    """(channels, height, width) of one latent."""
    c = model.config
    return int(c.in_channels), int(c.sample_size), int(c.sample_size)


# ------------------------------------------------------------------------------------- forward


def velocity(model: nn.Module, x: torch.Tensor, sigma: torch.Tensor, labels: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The predicted velocity (float32) at latents ``x`` [B, C, H, W], noise levels ``sigma`` [B] and
    class ``labels`` [B]; the network runs in ``dtype`` (default: its parameters')."""
    dtype = dtype or next(model.parameters()).dtype
    timestep = (sigma.float() * TIMESTEP_SCALE).to(x.device)
    out = model(x.to(dtype), timestep=timestep, class_labels=labels.to(x.device), return_dict=False)[0]
    return out[:, : x.shape[1]].float()  # a learned-sigma DiT returns 2C channels: the first C are v


class VelocityNet(nn.Module):
    """``velocity`` of a DiT as a module, so that ``torch.func.functional_call`` can run the DiT on
    other tensors (the trainer's compute-dtype casts of its fp32 masters)."""

    def __init__(self, dit: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.dit = dit
        self.dtype = dtype

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return velocity(self.dit, x, sigma, labels, self.dtype)


def to_image(latent: torch.Tensor) -> np.ndarray:
    """uint8 image [H, W, C] of a pixel-space latent [C, H, W] in [-1, 1] (values outside clamp)."""
    pixels = ((latent.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return pixels.permute(1, 2, 0).cpu().numpy()


def from_image(image: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Pixel-space latent [C, H, W] in [-1, 1] of a uint8 image [H, W, C]."""
    t = torch.as_tensor(np.asarray(image), dtype=torch.float32)
    return (t / 127.5 - 1).permute(2, 0, 1).contiguous()


# ------------------------------------------------------------------------------ exact numerics


def set_exact_numerics(model: nn.Module) -> nn.Module:
    """Switch ``model`` (in place) to batch-invariant kernels: see the module docstring. Call after
    any peft injection, so that its adapter linears are switched too. Idempotent."""
    from noria.models.decoder import row_chunked_linear

    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = functools.partial(_exact_linear, module, row_chunked_linear)
        elif isinstance(module, nn.Conv2d) and module.kernel_size == module.stride and module.padding == (0, 0):
            module.forward = functools.partial(_exact_patchify, module, row_chunked_linear)
        elif hasattr(module, "set_processor") and hasattr(module, "to_q"):  # diffusers' Attention
            module.set_processor(ExactAttnProcessor())
    return model


def _exact_linear(module: nn.Linear, linear: Any, x: torch.Tensor) -> torch.Tensor:
    return linear(x, module.weight, module.bias)


def _exact_patchify(conv: nn.Conv2d, linear: Any, x: torch.Tensor) -> torch.Tensor:
    """A stride = kernel convolution (patch embedding) as a row-chunked matmul over patches."""
    b, c, h, w = x.shape
    p, q = conv.kernel_size
    patches = x.reshape(b, c, h // p, p, w // q, q).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // q), c * p * q)
    out = linear(patches, conv.weight.reshape(conv.out_channels, -1), conv.bias)
    return out.transpose(1, 2).reshape(b, conv.out_channels, h // p, w // q)


class ExactAttnProcessor:
    """diffusers' self-attention (``AttnProcessor2_0``'s steps) with ``exact_attention`` in place of
    SDPA; cross-attention, masks and group norms are refused (the DiT uses none of them)."""

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Any = None,
                 attention_mask: Any = None, temb: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None or attn.group_norm is not None:
            raise NotImplementedError("exact attention covers the DiT's unmasked self-attention only")
        if attn.spatial_norm is not None or attn.norm_q is not None or attn.norm_k is not None:
            raise NotImplementedError("exact attention: q/k norms and spatial norms are not supported")
        b, n, _ = hidden_states.shape
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        head_dim = k.shape[-1] // attn.heads
        q, k, v = (t.view(b, n, attn.heads, head_dim) for t in (q, k, v))
        out = _ExactFull.apply(q, k, v).reshape(b, n, attn.heads * head_dim).to(q.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        if attn.residual_connection:
            out = out + hidden_states
        return out / attn.rescale_output_factor


class _ExactFull(torch.autograd.Function):
    """Unmasked attention q, k, v [B, n, H, D] -> [B, n, H, D]: forward exact, backward SDPA's."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from noria.models.attention import attention_scale, exact_attention

        ctx.save_for_backward(q, k, v)
        last = torch.full((q.shape[0], q.shape[1]), k.shape[1] - 1, dtype=torch.long, device=q.device)
        return exact_attention(q, k, v, attention_scale(q.shape[-1]), last)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        return torch.autograd.grad(out, (q, k, v), grad)
