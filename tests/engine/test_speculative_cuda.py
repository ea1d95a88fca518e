"""Speculative decoding on CUDA (the n-gram drafter): a verify chunk runs eagerly beside the CUDA
graphs of plain decode steps. Greedy with speculation equals greedy without, and in deterministic
mode (the fixed-order Triton kernels) speculated tokens' logprobs equal the trainer's
recomputation on the GPU bit for bit, as on CPU (tests/engine/test_speculative.py). Needs a CUDA GPU
with Triton: skipped elsewhere (CPU CI)."""

from __future__ import annotations

import pytest
import torch

from noria.models import exact_cuda

pytestmark = pytest.mark.skipif(not exact_cuda.available(), reason="needs a CUDA GPU with Triton")


def _engine(folder, dtype, method, **kw):
    from noria.config import EngineConfig
    from noria.config.engine import SpeculativeConfig
    from noria.engine import Engine
    from noria.models import load_model

    spec = SpeculativeConfig(method=method, num_tokens=4, max_batch=8, policy="always")
    settings = {"kv_cache_tokens": 8192, "block_size": 4, "chunked_prefill_size": 16, "max_batch_tokens": 128, **kw}
    return Engine(load_model(folder, dtype=dtype, device="cuda"), None, EngineConfig(speculative=spec, **settings))


def _prompts() -> list[list[int]]:
    """Prompts with copyable structure (a pattern repeated), of several lengths."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 300, (n,), generator=gen).tolist() * r for n, r in ((12, 3), (5, 4), (9, 2), (30, 1))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_with_speculation_equals_greedy_without_on_cuda(tiny_model_dir, dtype, caplog):
    """Token for token in one continuous batch. The greedy model repeats itself (a tiny random
    model does), so drafts are accepted; in bf16 a verify chunk's prefill rounding may differ from a
    decode step's, so only the tokens are compared there, and the logprobs within bf16's rounding.
    An engine that speculates beside CUDA graphs says at start that it will decode slower."""
    from noria.engine import GenerateRequest, SamplingParams

    plain = _engine(tiny_model_dir, dtype, "none")
    assert "speculative" not in caplog.text
    spec = _engine(tiny_model_dir, dtype, "ngram")
    assert spec.runner.graphs is not None and "decode slower, not faster" in caplog.text
    try:
        params = SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True)
        requests = [GenerateRequest(input_ids=p, sampling=params) for p in _prompts()]
        expected, got = plain.generate_batch(requests), spec.generate_batch(requests)
        m = spec.metrics()
    finally:
        plain.shutdown(1.0)
        spec.shutdown(1.0)
    assert m["spec_verify_steps"] > 0 and m["spec_accepted_tokens"] > 0, m
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    for e, g in zip(expected, got):
        assert g.output_ids == e.output_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, e.logprobs)) < tolerance


def test_deterministic_speculated_logprobs_equal_the_trainers_bitwise_on_cuda(tiny_model_dir):
    from noria.config import TrainConfig
    from noria.engine import GenerateRequest, SamplingParams
    from noria.train.fsdp import FSDPBackend
    from noria.train.packing import pack_samples
    from noria.types import Sample

    engine = _engine(tiny_model_dir, torch.bfloat16, "ngram", attention="torch", deterministic=True)
    try:
        prompts = _prompts()
        params = [SamplingParams(temperature=0.7, max_new_tokens=24, ignore_eos=True, seed=i) for i in range(len(prompts))]
        outs = engine.generate_batch([GenerateRequest(input_ids=p, sampling=s) for p, s in zip(prompts, params)])
        m = engine.metrics()
    finally:
        engine.shutdown(1.0)
    assert m["spec_verify_steps"] > 0, m
    samples = [
        Sample(prompt_ids=p, response_ids=o.output_ids, loss_mask=[1] * len(o.output_ids), rollout_logprobs=o.logprobs,
               weight_versions=o.weight_versions)
        for p, o in zip(prompts, outs)
    ]
    batch = pack_samples(samples, torch.linspace(-1, 1, len(samples)).tolist())
    backend = FSDPBackend(TrainConfig(param_dtype="bfloat16", algorithm="rl", device="cuda", logprob_chunk_tokens=50),
                          deterministic=True, temperature=0.7)
    backend.init(str(tiny_model_dir))
    trained = batch.loss_mask > 0
    lp = backend.compute_logprobs(batch).logprobs[trained].cpu()
    assert (lp - batch.rollout_logprobs[trained]).abs().max().item() == 0.0
