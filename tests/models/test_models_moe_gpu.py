"""Qwen3-MoE on CUDA: grouped expert GEMMs, exact mode, the engine's graph path with routes,
engine-vs-trainer bits in deterministic mode. Needs a CUDA GPU (skipped on CPU; run by
``PARTS=moe scripts/gpu.sh``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_util import fresh_routes, tiny_moe_folder
from noria.models import exact_cuda, load_model
from noria.models.moe import SparseMoeBlock, grouped_experts, grouped_ok, loop_experts, route_mismatch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _experts(n=300, h=256, inter=128, experts=16, k=4, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, h, generator=g, device="cuda").to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, h, generator=g, device="cuda") / h**0.5).to(dtype)
    down = (torch.randn(experts, h, inter, generator=g, device="cuda") / inter**0.5).to(dtype)
    idx = torch.rand(n, experts, generator=g, device="cuda").topk(k, dim=-1).indices.sort(-1).values
    w = torch.rand(n, k, generator=g, device="cuda")
    return x, idx, w, gate_up, down


def test_grouped_gemm_path_matches_the_expert_loop_and_trains():
    x, idx, w, gate_up, down = _experts()
    assert grouped_ok(x, gate_up, down), "torch._grouped_mm is expected on this GPU (bf16, aligned shapes)"
    grouped = grouped_experts(x, idx, w, gate_up, down)
    loop = loop_experts(x, idx, w, gate_up, down, F.linear)
    assert ((grouped.float() - loop.float()).norm() / loop.float().norm()).item() < 1e-2
    params = [t.clone().requires_grad_() for t in (x, gate_up, down)]
    grouped_experts(params[0], idx, w, params[1], params[2]).float().square().sum().backward()
    refs = [t.clone().requires_grad_() for t in (x, gate_up, down)]
    loop_experts(refs[0], idx, w, refs[1], refs[2], F.linear).float().square().sum().backward()
    for p, r in zip(params, refs):
        assert ((p.grad.float() - r.grad.float()).norm() / r.grad.float().norm()).item() < 2e-2


def test_training_under_bf16_autocast_takes_the_grouped_path_and_matches_the_loop():
    from noria.models import moe

    x, idx, w, gate_up, down = _experts(dtype=torch.float32)  # fp32 master weights, as the trainer
    block = SparseMoeBlock.__new__(SparseMoeBlock)
    torch.nn.Module.__init__(block)
    block.exact_dtype = None
    block.experts = torch.nn.Module()
    block.experts.gate_up_proj = torch.nn.Parameter(gate_up.clone())
    block.experts.down_proj = torch.nn.Parameter(down.clone())
    calls = []
    real = moe.grouped_experts
    moe.grouped_experts = lambda *a: calls.append(1) or real(*a)
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = block._experts(x, idx, w)
    finally:
        moe.grouped_experts = real
    assert calls and out.dtype == torch.float32
    out.square().sum().backward()
    ref = loop_experts(x, idx, w, gate_up.requires_grad_(), down, F.linear)
    ref.square().sum().backward()
    assert ((out - ref).norm() / ref.norm()).item() < 2e-2
    g = block.experts.gate_up_proj.grad
    assert ((g - gate_up.grad).norm() / gate_up.grad.norm()).item() < 3e-2


def test_grouped_gemm_with_idle_experts_and_in_a_cuda_graph():
    x, idx, w, gate_up, down = _experts(n=8, experts=64, k=2)  # most experts get no token
    eager = grouped_experts(x, idx, w, gate_up, down)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        grouped_experts(x, idx, w, gate_up, down)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = grouped_experts(x, idx, w, gate_up, down)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.skipif(not exact_cuda.available(), reason="needs Triton")
def test_exact_mode_gives_a_token_the_same_bits_in_any_call_on_cuda(tmp_path):
    folder = tiny_moe_folder(tmp_path, experts=4, top_k=1)
    model = load_model(folder, dtype=torch.bfloat16, device="cuda")
    model.set_exact_numerics(torch.bfloat16)
    block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
    g = torch.Generator(device="cuda").manual_seed(5)
    crowd = torch.randn(1, 161, 64, generator=g, device="cuda").bfloat16()
    full = block(crowd)
    for i in (0, 80, 160):
        assert torch.equal(block(crowd[:, i : i + 1])[0, 0], full[0, i])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 0.1)])
def test_cuda_logits_match_transformers(tmp_path, dtype, tol):
    from transformers import AutoModelForCausalLM

    folder = tiny_moe_folder(tmp_path)
    native = load_model(folder, dtype=dtype, device="cuda")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to("cuda").eval()
    ids = torch.randint(3, 300, (2, 40), device="cuda")
    with torch.no_grad():
        diff = (native(ids).float() - hf(ids).logits.float()).abs().amax(-1)  # per position
    if dtype == torch.float32:
        assert diff.max().item() <= tol
    else:  # bf16 rounding can flip a near-tie route, and that position's logits then differ widely
        assert (diff > tol).float().mean().item() <= 0.05, diff


def test_engine_on_cuda_returns_routes_from_its_graphs(tmp_path):
    from noria.config import EngineConfig
    from noria.engine import Engine, GenerateRequest, SamplingParams

    folder = tiny_moe_folder(tmp_path)
    engine = Engine(load_model(folder, dtype=torch.bfloat16, device="cuda"), None,
                    EngineConfig(kv_cache_tokens=8192, max_running_requests=8))
    prompts = [list(range(3 + i, 40 + i)) for i in range(6)]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    try:
        outs = engine.generate_batch([GenerateRequest(p, params, return_routed_experts=True) for p in prompts])
        graphs = len(engine.runner.graphs._graphs)
    finally:
        engine.shutdown(1)
    assert graphs > 0  # decode steps ran from CUDA graphs
    model = load_model(folder, dtype=torch.bfloat16, device="cuda")
    differing = total = 0
    for p, out in zip(prompts, outs):
        assert out.routed_experts.shape == (24, 2, 2)
        seq = p + out.output_ids
        want = fresh_routes(model, seq[:-1], exact=False).cpu()[len(p) - 1 :]
        d, n = route_mismatch(out.routed_experts, want)
        differing, total = differing + d, total + n
    assert differing <= 0.05 * total  # other kernels, other rounding: a few near ties may flip


@pytest.mark.skipif(not exact_cuda.available(), reason="needs Triton")
def test_deterministic_moe_engine_and_trainer_agree_bitwise_on_cuda(tmp_path):
    from noria.config import EngineConfig, TrainConfig
    from noria.engine import Engine, GenerateRequest, SamplingParams
    from noria.train.fsdp import FSDPBackend
    from noria.train.packing import pack_samples
    from noria.types import Sample

    folder = tiny_moe_folder(tmp_path)
    engine = Engine(load_model(folder, dtype=torch.bfloat16, device="cuda"), None,
                    EngineConfig(kv_cache_tokens=4096, block_size=16, chunked_prefill_size=32, deterministic=True))
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 90)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=i) for i in range(3)]
    try:
        outs = engine.generate_batch([GenerateRequest(p, s, return_routed_experts=True) for p, s in zip(prompts, params)])
    finally:
        engine.shutdown(1)
    samples = [Sample(prompt_ids=p, response_ids=o.output_ids, loss_mask=[1] * 16, rollout_logprobs=o.logprobs,
                      weight_versions=o.weight_versions, routed_experts=o.routed_experts) for p, o in zip(prompts, outs)]
    batch = pack_samples(samples, [1.0, -1.0, 0.5], replay_routes=True)
    backend = FSDPBackend(TrainConfig(param_dtype="bfloat16", device="cuda"), deterministic=True)
    backend.init(folder)
    trained = batch.loss_mask > 0
    lp = backend.compute_logprobs(batch).logprobs[trained]
    assert (lp - batch.rollout_logprobs[trained]).abs().max().item() == 0.0
    metrics = backend.train_step(batch)
    assert metrics["rollout_logprob_abs_diff_max"] == 0.0 and metrics["moe/router_disagreement"] == 0.0
