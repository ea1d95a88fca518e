"""Tiny random Qwen3-MoE models for the engine, trainer and RL tests (no hub).

``tiny_moe_args`` is a 2-3 layer Qwen3-MoE shape small enough for 2 CPU cores; ``tiny_moe_folder``
saves one (HF layout, per-expert tensors) with random weights, optionally with the shared test
tokenizer. ``router_scale`` shrinks the routers' weights: near-tied router logits, so that two
numerics (bf16 engine, fp32 trainer) route some tokens differently, as real MoE runs do.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from noria.models import DecoderLM, PackedContext, load_model, save_model
from noria.models.config import ModelArgs, MoeArgs, RopeScaling
from noria.models.moe import Routing, SparseMoeBlock


def tiny_moe_args(vocab: int = 300, experts: int = 8, top_k: int = 2, layers: int = 2, mlp_only=(), **kw) -> ModelArgs:
    moe = MoeArgs(num_experts=experts, top_k=top_k, intermediate_size=32, norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=tuple(mlp_only), router_aux_loss_coef=0.001)
    base = dict(model_type="qwen3_moe", vocab_size=vocab, hidden_size=64, intermediate_size=96, num_layers=layers,
                num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                rope_scaling=RopeScaling(), qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True,
                tie_word_embeddings=False, max_position_embeddings=512, bos_token_id=None, eos_token_ids=(2,), moe=moe)
    return ModelArgs(**{**base, **kw})


def tiny_moe_folder(root: Path, name: str = "moe", tokenizer_dir: Path | None = None, router_scale: float = 1.0,
                    seed: int = 0, std: float = 0.15, **kw) -> Path:
    """Save a random tiny Qwen3-MoE (fp32 weights that bf16 cannot hold exactly) under root/name;
    ``std`` 0.02 is transformers' init (a near-uniform policy to start RL from)."""
    torch.manual_seed(seed)
    model = DecoderLM(tiny_moe_args(**kw))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + (0.1 if std > 0.05 else 0.0) * torch.randn_like(p))
            elif pname.endswith("mlp.gate.weight"):
                p.copy_(router_scale * 2 * std * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))
    out = save_model(model, root / name)
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors") and "index" not in f.name:
                shutil.copy2(f, out / f.name)
    return out


def fresh_routes(model: DecoderLM, ids: list[int], exact: bool) -> torch.Tensor:
    """The model's own routes [len(ids), L, k] for one sequence, forward from scratch."""
    routing = Routing()
    with torch.no_grad():
        model(torch.tensor([ids], device=model.lm_head.weight.device), attn=PackedContext([len(ids)], deterministic=exact), routing=routing)
    return routing.routes()[0]


def load_exact(folder, dtype: torch.dtype, exact: bool = True) -> DecoderLM:
    model = load_model(folder, dtype=dtype)
    if exact:
        model.set_exact_numerics(dtype)
    return model


@torch.no_grad()
def permuted_experts(model: DecoderLM, seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict of the same function with every MoE layer's experts renumbered: the logits do
    not change, the expert ids of every route do."""
    gen = torch.Generator().manual_seed(seed)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, SparseMoeBlock):
            perm = torch.randperm(module.gate.weight.shape[0], generator=gen)
            for leaf in ("gate.weight", "experts.gate_up_proj", "experts.down_proj"):
                key = f"{name}.{leaf}"
                state[key] = state[key][perm].contiguous()
    return state
