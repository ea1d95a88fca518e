"""Deterministic mode on CUDA: the fixed-order Triton kernels of ``noria.models.exact_cuda`` give a
row the same bits in any call, the engine's deterministic mode is batch-invariant there, and the
engine's rollout logprobs equal the trainer's recomputation bit for bit (as on CPU, see
tests/engine/test_exact_agreement.py). Needs a CUDA GPU with Triton: skipped elsewhere (CPU CI)."""

from __future__ import annotations

import pytest
import torch

from noria.models import exact_cuda

pytestmark = pytest.mark.skipif(not exact_cuda.available(), reason="needs a CUDA GPU with Triton")


@pytest.mark.parametrize("k_in,n_out,bias", [(64, 300, False), (2048, 6144, True), (96, 151936, False)])
def test_linear_gives_a_row_the_same_bits_in_any_call(k_in, n_out, bias):
    g = torch.Generator(device="cuda").manual_seed(k_in)
    w = (torch.randn(n_out, k_in, generator=g, device="cuda") * 0.05).bfloat16()
    b = torch.randn(n_out, generator=g, device="cuda").bfloat16() if bias else None
    x = torch.randn(300, k_in, generator=g, device="cuda").bfloat16()
    full = exact_cuda.linear(x, w, b)
    for rows in (slice(7, 8), slice(0, 3), slice(100, 164), slice(5, 262)):
        assert torch.equal(exact_cuda.linear(x[rows], w, b), full[rows]), rows
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert ((full.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_rms_norm_gives_a_row_the_same_bits_and_the_module_gradient():
    x = torch.randn(513, 2048, device="cuda").bfloat16()
    w = (1 + 0.1 * torch.randn(2048, device="cuda")).bfloat16()
    full = exact_cuda.rms_norm(x, w, 1e-6)
    for rows in (slice(3, 4), slice(0, 2), slice(200, 456)):
        assert torch.equal(exact_cuda.rms_norm(x[rows], w, 1e-6), full[rows])
    ref = exact_cuda._rms_norm_torch(x, w, 1e-6)
    assert ((full.float() - ref.float()).abs().max()).item() <= 2 ** -6 * ref.float().abs().max().item()
    xg, wg = x.float().requires_grad_(), w.float().requires_grad_()
    exact_cuda.rms_norm(xg, wg, 1e-6).square().sum().backward()
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    exact_cuda._rms_norm_torch(xr, wr, 1e-6).square().sum().backward()
    # The backward is the module's own ops; only the upstream gradient (2 * out) differs in rounding.
    assert torch.allclose(xg.grad, xr.grad, rtol=1e-3, atol=1e-5)
    assert torch.allclose(wg.grad, wr.grad, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("hq,hkv,d", [(16, 8, 128), (4, 2, 16), (6, 2, 64)])
def test_attention_gives_a_query_the_same_bits_in_any_call(hq, hkv, d):
    from noria.models.attention import exact_attention

    g = torch.Generator(device="cuda").manual_seed(hq + d)
    batch, length = 3, 700
    q = torch.randn(batch, 40, hq, d, generator=g, device="cuda").bfloat16()
    k = torch.randn(batch, length, hkv, d, generator=g, device="cuda").bfloat16()
    v = torch.randn(batch, length, hkv, d, generator=g, device="cuda").bfloat16()
    pos = torch.arange(600, 640, device="cuda").expand(batch, 40)
    full = exact_attention(q, k, v, 0.1, pos)
    # One query of one row, over a context cut right after its last key, or padded with NaN keys.
    one = exact_attention(q[1:2, 17:18], k[1:2, :618], v[1:2, :618], 0.1, pos[1:2, 17:18])
    assert torch.equal(one, full[1:2, 17:18])
    k_nan, v_nan = k[2:3].clone(), v[2:3].clone()
    k_nan[:, 640:], v_nan[:, 640:] = float("nan"), float("nan")
    assert torch.equal(exact_attention(q[2:3], k_nan, v_nan, 0.1, pos[2:3]), full[2:3])
    # Against plain causal SDPA in fp32 over each query's keys.
    kk, vv = k[0, :640].float().repeat_interleave(hq // hkv, 1), v[0, :640].float().repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q[0].float(), kk) * 0.1
    visible = torch.arange(640, device="cuda")[None] <= pos[0][:, None]
    ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), vv)
    assert ((full[0].float() - ref).norm() / ref.norm()).item() < 1e-2


def test_deterministic_engine_is_batch_invariant_on_cuda(tiny_model_dir):
    from noria.config import EngineConfig
    from noria.engine import Engine, GenerateRequest, SamplingParams
    from noria.models import load_model

    engine = Engine(load_model(tiny_model_dir, dtype=torch.bfloat16, device="cuda"), None,
                    EngineConfig(kv_cache_tokens=4096, block_size=4, chunked_prefill_size=16, deterministic=True))
    try:
        def req(n, seed):
            return GenerateRequest(input_ids=[3 + (7 * i + seed) % 300 for i in range(n)],
                                   sampling=SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=seed))

        alone = engine.generate_batch([req(37, 1)])[0]
        together = engine.generate_batch([req(5, 2), req(90, 3), req(37, 1), req(12, 4)])[2]
        assert together.output_ids == alone.output_ids and together.logprobs == alone.logprobs
    finally:
        engine.shutdown(1.0)


def test_deterministic_partial_block_reuse_is_bitwise_from_scratch_on_cuda(tiny_model_dir):
    # As tests/engine/test_prefix_tokens.py on CPU: a turn served from a partly reused block.
    from noria.config import EngineConfig
    from noria.engine import Engine, GenerateRequest, SamplingParams
    from noria.models import load_model

    model = load_model(tiny_model_dir, dtype=torch.bfloat16, device="cuda")
    settings = dict(kv_cache_tokens=4096, block_size=16, chunked_prefill_size=8, max_batch_tokens=24, deterministic=True)
    cached, scratch = (Engine(model, None, EngineConfig(**settings, prefix_cache=on)) for on in (True, False))
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=5)
        first = GenerateRequest(input_ids=[3 + (11 * i) % 300 for i in range(21)], sampling=params)
        out = cached.generate_batch([first])[0]
        second = GenerateRequest(input_ids=first.input_ids + out.output_ids + [17, 29, 31], sampling=params)
        warm, cold = cached.generate_batch([second])[0], scratch.generate_batch([second])[0]
        assert warm.cached_tokens == 30 and warm.cached_tokens % 16 != 0
        assert warm.output_ids == cold.output_ids and warm.logprobs == cold.logprobs
    finally:
        cached.shutdown(1.0)
        scratch.shutdown(1.0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_deterministic_engine_and_trainer_agree_bitwise_on_cuda(tmp_path, family):
    from exact_util import assert_exact_at_step_0, tiny_folder

    assert_exact_at_step_0(tiny_folder(family, tmp_path), device="cuda")
