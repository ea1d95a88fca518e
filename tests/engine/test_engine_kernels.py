"""The paged decode attention kernel against the gather + SDPA reference."""

import pytest
import torch

from noria.engine.kernels import cpu_kernel, paged_decode_attention, reference_paged_decode_attention


def _case(S, Hq, Hkv, D, block_size, dtype, max_len=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len, (S,), generator=g, dtype=torch.int32)
    lens[0] = 1  # a sequence holding only its own token
    n_blocks = int((lens.max() + block_size - 1) // block_size)
    total = S * n_blocks + 3
    pool_k = torch.randn(total * block_size, Hkv, D, generator=g).to(dtype)
    pool_v = torch.randn(total * block_size, Hkv, D, generator=g).to(dtype)
    tables = torch.randperm(total, generator=g)[: S * n_blocks].view(S, n_blocks).to(torch.int32)
    q = torch.randn(S, Hq, D, generator=g).to(dtype)
    return q, pool_k, pool_v, tables, lens


@pytest.fixture(scope="module")
def kernel():
    module = cpu_kernel()
    if module is None:
        pytest.fail("the C++ kernel did not build on this machine (a CPU with a C++ compiler and ninja)")
    return module


@pytest.mark.parametrize(
    "Hq, Hkv, D, dtype, tol",
    [
        (9, 3, 64, torch.bfloat16, 2e-2),  # SmolLM2 shape: register-resident fast path
        (16, 8, 128, torch.bfloat16, 2e-2),  # Qwen3-0.6B shape: fast path, D = 128
        (4, 1, 32, torch.bfloat16, 2e-2),  # generic path
        (9, 3, 64, torch.float32, 1e-5),
        (6, 6, 48, torch.float32, 1e-5),  # no GQA, odd width
    ],
)
def test_matches_reference(kernel, Hq, Hkv, D, dtype, tol):
    q, k, v, tables, lens = _case(11, Hq, Hkv, D, 16, dtype)
    out = paged_decode_attention(q, k, v, tables, lens, 16, D**-0.5, impl="cpu_kernel")
    ref = reference_paged_decode_attention(q.float(), k.float(), v.float(), tables, lens, 16, D**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.float() - ref).abs().max().item() < tol


def test_batch_invariant(kernel):
    q, k, v, tables, lens = _case(9, 9, 3, 64, 16, torch.bfloat16)
    together = paged_decode_attention(q, k, v, tables, lens, 16, 0.125, impl="cpu_kernel")
    for s in range(q.shape[0]):
        alone = paged_decode_attention(q[s : s + 1], k, v, tables[s : s + 1], lens[s : s + 1], 16, 0.125, impl="cpu_kernel")
        assert torch.equal(alone[0], together[s])


def test_rejects_mismatched_inputs(kernel):
    q, k, v, tables, lens = _case(3, 9, 3, 64, 16, torch.bfloat16)
    with pytest.raises(RuntimeError, match="int32"):
        paged_decode_attention(q, k, v, tables.long(), lens, 16, 0.125, impl="cpu_kernel")
    with pytest.raises(RuntimeError, match="dtype"):
        paged_decode_attention(q.float(), k, v, tables, lens, 16, 0.125, impl="cpu_kernel")


# --- the fused sampler (kernels/sampling.cpp) against the torch recipe in sampling.py ---

from noria.engine.sampling import _sample_torch  # noqa: E402


def _logits(S=37, V=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, V, generator=g) * 3, torch.rand(S, generator=g)


def test_fused_sampler_greedy_equals_argmax_and_log_softmax(kernel):
    logits, u = _logits()
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the lower id wins, as in torch
    ids, lps = kernel.sample_rows(logits, torch.zeros(len(u)), u)
    assert torch.equal(ids, logits.argmax(-1))
    ref = torch.log_softmax(logits, -1).gather(1, ids[:, None])[:, 0]
    assert (lps - ref).abs().max().item() < 1e-5


def test_fused_sampler_matches_the_torch_inverse_cdf(kernel):
    logits, u = _logits()
    temps = torch.linspace(0.3, 2.0, len(u))
    ids, lps = kernel.sample_rows(logits, temps, u)
    ref_ids, ref_lps = _sample_torch(logits, temps, u)
    # Both take the first id whose running mass exceeds u (different summation order: u landing
    # within rounding of a CDF step could split them, which these draws do not).
    assert torch.equal(ids, ref_ids)
    assert (lps - ref_lps).abs().max().item() < 1e-5


def test_fused_sampler_bf16_equals_widened_fp32_and_is_batch_invariant(kernel):
    logits, u = _logits(V=49152)
    temps = torch.tensor([0.0, 1.0, 0.7] * 12 + [1.3])
    together = kernel.sample_rows(logits.bfloat16(), temps, u)
    widened = kernel.sample_rows(logits.bfloat16().float(), temps, u)
    assert all(torch.equal(a, b) for a, b in zip(together, widened))
    for r in range(0, len(u), 5):
        alone = kernel.sample_rows(logits[r : r + 1].bfloat16(), temps[r : r + 1], u[r : r + 1])
        assert alone[0].item() == together[0][r].item() and torch.equal(alone[1][0], together[1][r])


def test_fused_sampler_draws_from_the_distribution(kernel):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    ids, _ = kernel.sample_rows(probs.log().repeat(n, 1), torch.ones(n), torch.rand(n, generator=torch.Generator().manual_seed(1)))
    freq = torch.bincount(ids, minlength=4).float() / n
    assert (freq - probs).abs().max().item() < 0.015


def test_prefill_through_the_kernel_matches_sdpa_and_ignores_chunking(kernel, tiny_model_dir):
    """CPU engines attend prefill tokens with the paged kernel (``ModelRunner.kernel_prefill``): the
    same greedy tokens as the gather + SDPA prefill and close logprobs, chunked or not, with a
    prefix-cache hit or not."""
    from noria.config import EngineConfig
    from noria.engine import Engine, GenerateRequest, SamplingParams
    from noria.models import load_model

    model = load_model(tiny_model_dir, dtype=torch.float32)
    shared = [3 + (7 * i) % 400 for i in range(37)]
    reqs = [GenerateRequest(input_ids=shared + tail, sampling=SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
            for tail in ([5, 6], [9], list(range(40, 70)))]

    def run(**kw):
        settings = dict(kv_cache_tokens=2048, block_size=4, max_batch_tokens=64, **kw)
        engine = Engine(model, None, EngineConfig(**settings))
        try:
            return engine.runner.kernel_prefill, [engine.generate_batch([r])[0] for r in reqs]
        finally:
            engine.shutdown(1)

    on, chunked = run(chunked_prefill_size=8)
    _, whole = run(chunked_prefill_size=64, prefix_cache=False)
    off, sdpa = run(chunked_prefill_size=8, attention="torch")
    assert on and not off
    assert chunked[1].cached_tokens > 0 and whole[1].cached_tokens == 0
    for a, b, c in zip(chunked, whole, sdpa):
        assert a.output_ids == b.output_ids == c.output_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5  # matmul row counts differ
        assert max(abs(x - y) for x, y in zip(a.logprobs, c.logprobs)) < 1e-4
