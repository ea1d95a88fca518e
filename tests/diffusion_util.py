"""Helpers of the diffusion tests: a tiny random DiT folder, trainer and engine configs, a rollout.

Real components only: diffusers' DiT saved as a diffusers folder, the real engine and trainer.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("diffusers")

TINY_DIT = {
    "_class_name": "DiTTransformer2DModel", "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 1,
    "out_channels": 1, "num_layers": 2, "sample_size": 8, "patch_size": 2, "num_embeds_ada_norm": 10,
    "norm_type": "ada_norm_zero", "norm_elementwise_affine": False,
}  # fmt: skip


def write_dit(folder: Path, seed: int = 0, weights: bool = True, **overrides) -> Path:
    """A diffusers DiT folder; with ``weights``, random weights whose adaLN-zero layers are NOT
    zero (a fresh DiT predicts 0 everywhere, which would hide numerical differences)."""
    import torch

    from noria.diffusion.model import load_dit, save_dit

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**TINY_DIT, **overrides}))
    if weights:
        model = load_dit(folder, allow_new=True, seed=seed)
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        save_dit(model, folder)
    return folder


def train_config(**changes):
    from noria.config import TrainConfig

    cfg = TrainConfig(algorithm=changes.pop("algorithm", "rl"), param_dtype=changes.pop("param_dtype", "auto"))
    for key, value in changes.items():
        section, _, name = key.rpartition(".")
        setattr(getattr(cfg, section) if section else cfg, name, value)
    cfg.validate()
    return cfg


def diffusion_config(**changes):
    from noria.config import DiffusionConfig

    cfg = DiffusionConfig(**changes)
    cfg.validate()
    return cfg


def rollout(engine, dcfg, labels, seed=0, group=0):
    """Samples of ``labels`` through the real generate function and the in-process client."""
    from noria.diffusion.rollout import generate_fn
    from noria.rollout import LocalEngineClient, RolloutContext
    from noria.types import Sample

    ctx = RolloutContext(LocalEngineClient(engine), None, None, seed=seed)
    gen = generate_fn(dcfg.steps, dcfg.noise_level, dcfg.shift)
    samples = [Sample(prompt_ids=[c], group_id=group, index=i) for i, c in enumerate(labels)]

    async def run():
        return await asyncio.gather(*(gen(ctx, s) for s in samples))

    return asyncio.run(run())
