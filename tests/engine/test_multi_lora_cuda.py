"""Many LoRA adapters in one engine on CUDA: a mixed batch gives each row its adapter alone (fp32
within 1e-5 eagerly; bitwise in deterministic mode with Triton), steps with adapter rows run
eagerly beside graph-replayed base steps, and a bf16 engine matches its own fp32 reference
closely. Needs a CUDA GPU: skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from noria.config import EngineConfig
from noria.engine.engine import Engine
from noria.engine.protocol import GenerateRequest, SamplingParams
from noria.models import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPT = [3, 17, 42, 7, 99, 5, 23, 61, 8, 14, 31, 2, 77, 40, 9, 12, 55, 6]


@pytest.fixture(scope="module")
def folders(tiny_model_dir, tmp_path_factory):
    from test_multi_lora import adapter_folder

    cpu = load_model(tiny_model_dir, dtype=torch.float32)
    root = tmp_path_factory.mktemp("adapters")
    return {name: adapter_folder(cpu, root / name, seed) for seed, name in enumerate("ab")}


def run(engine: Engine, adapters: list, new: int = 8) -> list:
    reqs = [GenerateRequest(list(PROMPT), SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True), adapter=a)
            for a in adapters]  # fmt: skip
    return engine.generate_batch(reqs, timeout_s=120)


@pytest.mark.parametrize("dtype,deterministic", [(torch.float32, False), (torch.bfloat16, True)], ids=["fp32", "bf16-deterministic"])
def test_mixed_batch_on_cuda_equals_each_adapter_alone(tiny_model_dir, folders, dtype, deterministic):
    if deterministic:
        from noria.models import exact_cuda

        if not exact_cuda.available():
            pytest.skip("deterministic CUDA needs Triton")
    model = load_model(tiny_model_dir, dtype=dtype, device="cuda")
    engine = Engine(model, None, EngineConfig(kv_cache_tokens=4096, block_size=16, deterministic=deterministic, prefix_cache=False))
    try:
        engine.load_adapter("a", folders["a"])
        engine.load_adapter("b", folders["b"])
        mix = ["a", None, "b", "a"]
        mixed = run(engine, mix)
        for out, name in zip(mixed, mix):
            alone = run(engine, [name])[0]
            assert out.output_ids == alone.output_ids, name
            if deterministic:
                assert out.logprobs == alone.logprobs, name
            else:
                assert max(abs(x - y) for x, y in zip(out.logprobs, alone.logprobs)) <= 1e-5, name
        assert mixed[0].logprobs != mixed[1].logprobs  # the adapter changes the row
    finally:
        engine.shutdown()


def test_adapter_rows_run_eagerly_beside_graph_steps(tiny_model_dir, folders):
    model = load_model(tiny_model_dir, dtype=torch.bfloat16, device="cuda")
    engine = Engine(model, None, EngineConfig(kv_cache_tokens=4096, block_size=16, prefix_cache=False))
    try:
        if engine.runner.graphs is None:
            pytest.skip("no CUDA graphs on this model")
        engine.load_adapter("a", folders["a"])
        base_before = run(engine, [None, None])
        with_a = run(engine, ["a", None])
        base_after = run(engine, [None, None])
        assert base_before[0].logprobs == base_after[0].logprobs  # graph steps are unchanged by adapters
        assert with_a[0].logprobs != with_a[1].logprobs
        assert abs(with_a[1].logprobs[0] - base_before[0].logprobs[0]) < 0.1  # the base row of a mixed (eager) step
    finally:
        engine.shutdown()
