"""``noria bench diffusion --tiny`` on a CPU: the engine, diffusers' pipeline loop and both trainer
cases run end to end and write the JSON shape (figures on this shared machine mean nothing; the
lead runs the CUDA shape, see docs/diffusion.md)."""

from __future__ import annotations

import json

import pytest

from noria.bench import BENCHMARKS, parse_bench_args

pytest.importorskip("diffusers")


def test_diffusion_bench_runs_tiny_and_writes_every_case(tmp_path):
    out = tmp_path / "diffusion.json"
    module, args = parse_bench_args("diffusion", ["--tiny", "--dtype", "float32", "--json", str(out)])
    assert module.main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "diffusion" and doc["cpu"]["cores"] >= 1
    ode, sde, sft, grpo = doc["results"]
    assert "sample ode batch=4 steps=3" in ode["case"] and "sample sde" in sde["case"]
    for case in (ode, sde):
        assert case["metric"] == "images_per_s" and case["noria"] > 0 and case["peers"]["diffusers_pipeline"] > 0
    assert sft["metric"] == "samples_per_s" and sft["noria"] > 0 and sft["peers"]["diffusers_train_loop"] > 0
    assert "flow_grpo images=4 steps=3" in grpo["case"] and grpo["noria"] > 0


def test_the_cuda_shape_is_sd3_medium_sized():
    """The H200 case: width 1536, 24 layers, a 512x512 image's 64x64x16 latent (1,024 tokens)."""
    import torch

    from noria.bench.diffusion import BASE, SHAPES, dit_flops_per_image

    assert "diffusion" in BENCHMARKS
    from diffusers import DiTTransformer2DModel

    shape = SHAPES["sd3-medium"]
    assert shape["num_attention_heads"] * shape["attention_head_dim"] == 1536 and shape["num_layers"] == 24
    with torch.device("meta"):
        model = DiTTransformer2DModel.from_config({**BASE, **shape})
    params = sum(p.numel() for p in model.parameters())
    assert 0.9e9 < params < 1.2e9, params  # 1.1B: attention and MLP, plus adaLN-Zero's 6 x width^2 per block
    flops = dit_flops_per_image(model)
    assert 2 * 0.6e9 * 1024 < flops < 2 * params * 1024 + 4 * 1024**2 * 1536 * 24, flops
