"""The engine's CUDA path (Triton paged attention, CUDA graphs of decode steps, device sampling).
Needs a CUDA GPU with Triton: skipped elsewhere (CPU CI)."""

from __future__ import annotations

import pytest
import torch

from noria.engine import attention_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _case(seqs, hq, hkv, d, block_size, lens, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nblocks = sum(-(-n // block_size) for n in lens) + 8
    k = torch.randn(nblocks * block_size + 1, hkv, d, generator=g, device="cuda").to(dtype)
    v = torch.randn(nblocks * block_size + 1, hkv, d, generator=g, device="cuda").to(dtype)
    width = max(-(-n // block_size) for n in lens) + 2  # padded tables, as the runner builds them
    perm = torch.randperm(nblocks, generator=g, device="cuda")
    tables = perm[: seqs * width].view(seqs, width).int() if seqs * width <= nblocks else torch.randint(
        0, nblocks, (seqs, width), generator=g, device="cuda").int()
    q = torch.randn(seqs, hq, d, generator=g, device="cuda").to(dtype)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("hq,hkv,d", [(16, 8, 128), (9, 3, 64), (32, 4, 128), (8, 8, 64)])
@pytest.mark.parametrize("block_size", [16, 4])
def test_triton_decode_matches_reference(hq, hkv, d, block_size):
    from noria.engine.cuda import paged_attention, triton_available

    if not triton_available():
        pytest.skip("no triton")
    for seed, lens in enumerate([[1, 17, 300, 64], [1000] * 3, list(range(1, 130, 7))]):
        q, k, v, tables, cl = _case(len(lens), hq, hkv, d, block_size, lens, torch.bfloat16, seed)
        ref = attention_ref.paged_decode_attention(q.double(), k.double(), v.double(), tables, cl, block_size, d**-0.5)
        out = paged_attention.paged_decode_attention(q, k, v, tables, cl, block_size, d**-0.5)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (seed, err)
        assert torch.isfinite(out).all()


def test_triton_decode_split_context_equals_reference():
    from noria.engine.cuda import paged_attention, triton_available

    if not triton_available():
        pytest.skip("no triton")
    lens = [3000, 5, 777]  # few sequences: the context is split over several programs
    q, k, v, tables, cl = _case(3, 16, 8, 128, 16, lens, torch.bfloat16, 7)
    assert paged_attention.choose_splits(3, 8, tables.shape[1] * 16) > 1
    ref = attention_ref.paged_decode_attention(q.double(), k.double(), v.double(), tables, cl, 16, 0.1)
    out = paged_attention.paged_decode_attention(q, k, v, tables, cl, 16, 0.1)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


def _engine(model_dir, dtype, **kw):
    from noria.config import EngineConfig
    from noria.engine import Engine
    from noria.models import load_model

    cfg = EngineConfig(kv_cache_tokens=4096, block_size=4, max_running_requests=16, **kw)
    return Engine(load_model(model_dir, dtype=dtype, device="cuda"), None, cfg)


def _generate(engine, prompts, n, **sampling):
    from noria.engine.protocol import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=n, ignore_eos=True, **sampling)
    return engine.generate_batch([GenerateRequest(input_ids=p, sampling=params) for p in prompts])


PROMPTS = [[1, 5, 9, 13, 2, 7], [3] * 30, [4, 8, 15, 16, 23, 42, 4, 8, 15], [11, 12], [20 + i for i in range(50)]]


def test_cuda_graph_decode_equals_eager(tiny_model_dir):
    """fp32 model: graphs (padded buckets) and eager steps give the same tokens and close logprobs."""
    graph = _engine(tiny_model_dir, torch.float32)
    eager = _engine(tiny_model_dir, torch.float32)
    eager.runner.graphs = None
    try:
        assert graph.runner.graphs is not None
        a, b = _generate(graph, PROMPTS, 24, temperature=0.0), _generate(eager, PROMPTS, 24, temperature=0.0)
        assert graph.runner.graphs._graphs, "no decode step went through a graph"
        for x, y in zip(a, b):
            assert x.output_ids == y.output_ids
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-3
    finally:
        graph.shutdown(1.0)
        eager.shutdown(1.0)


def test_cuda_engine_matches_torch_reference(tiny_model_dir):
    """Triton + graphs vs the torch reference attention, both eager-free of each other (fp32)."""
    fast = _engine(tiny_model_dir, torch.float32)
    ref = _engine(tiny_model_dir, torch.float32, attention="torch")
    ref.runner.graphs = None
    try:
        a, b = _generate(fast, PROMPTS, 16, temperature=0.0), _generate(ref, PROMPTS, 16, temperature=0.0)
        for x, y in zip(a, b):
            assert x.output_ids == y.output_ids
    finally:
        fast.shutdown(1.0)
        ref.shutdown(1.0)


def test_seeded_sampling_on_cuda_is_batch_independent(tiny_model_dir):
    engine = _engine(tiny_model_dir, torch.float32)
    try:
        alone = _generate(engine, PROMPTS[:1], 12, temperature=1.0, seed=3)[0]
        together = _generate(engine, PROMPTS, 12, temperature=1.0, seed=3)[0]
        assert alone.output_ids == together.output_ids
    finally:
        engine.shutdown(1.0)


def test_weight_update_recaptures_graphs(tiny_model_dir):
    engine = _engine(tiny_model_dir, torch.float32)
    try:
        before = _generate(engine, PROMPTS[:2], 8, temperature=0.0)
        assert engine.runner.graphs._graphs
        state = {n: t * 1.5 for n, t in engine.model.state_dict().items() if n != "lm_head.weight"}
        engine.update_weights_from_state_dict(state, version=1)
        assert not engine.runner.graphs._graphs  # cleared: the parameters moved
        after = _generate(engine, PROMPTS[:2], 8, temperature=0.0)
        assert after[0].weight_versions[-1] == 1
        eager = _engine(tiny_model_dir, torch.float32)
        eager.runner.graphs = None
        eager.update_weights_from_state_dict(state, version=1)
        assert [o.output_ids for o in _generate(eager, PROMPTS[:2], 8, temperature=0.0)] == [o.output_ids for o in after]
        eager.shutdown(1.0)
        assert before is not None
    finally:
        engine.shutdown(1.0)
