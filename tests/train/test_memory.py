"""Memory of the colocated main job's parts: the KV pools cost only the blocks written, also when
the C heap has churned (as after a trainer turn, when the engine allocates them again), and go back
to the kernel when dropped (``noria.engine.kv_cache.zeroed_pools``)."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from types import SimpleNamespace

import torch

from noria.config import EngineConfig, load_config
from noria.engine.kv_cache import KVCache, zeroed_pools
from noria.process.usage import status_bytes

MAIN_JOB = Path(__file__).resolve().parents[2] / "examples" / "grpo_smollm2_arithmetic.yaml"


def _rss() -> int:
    return status_bytes(os.getpid(), "VmRSS")


def test_small_kv_pools_stay_lazy_after_a_large_free_and_go_back_to_the_kernel():
    # A 20 MB buffer freed first raises glibc's dynamic mmap threshold above a 12.6 MB pool, so
    # malloc would serve the pools from the heap (as after a trainer step).
    big = torch.ones(5 * 2**20)
    del big
    gc.collect()
    shape = (32768, 3, 64)  # SmolLM2-135M's pool at 32768 tokens: 12.6 MB a layer
    before = _rss()
    k, v = zeroed_pools(30, shape, torch.bfloat16, "cpu")
    assert sum(p.numel() * p.element_size() for p in k + v) == 2 * 30 * 32768 * 3 * 64 * 2  # 755 MB
    assert _rss() - before < 32 * 2**20
    assert k[7][:100].abs().sum().item() == 0 and v[29][-1].abs().sum().item() == 0
    for pool in k + v:  # every layer writes its first 1024 slots (64 blocks of 16)
        pool[:1024] = 1.0
    touched = 60 * 1024 * 3 * 64 * 2  # 23.6 MB
    assert k[3][:1024].float().sum().item() == 1024 * 3 * 64 and k[3][1024:2048].abs().sum().item() == 0
    written = _rss()
    assert written - before < touched + 32 * 2**20
    del k, v, pool
    gc.collect()
    assert written - _rss() > 0.9 * touched  # unmapped, not kept in the heap


def test_the_kv_cache_is_sized_from_what_the_job_can_use():
    cfg = load_config(MAIN_JOB, ["--engine.kv_cache_tokens", "null"])
    # 8 prompts x 8 samples generate together (more than an evaluation batch of 32), each at most
    # 256 prompt tokens + 64 (eval's answers are the longer) + one partial block of 16.
    assert cfg.engine.kv_job_tokens == 64 * (256 + 64 + 16)
    wider = load_config(MAIN_JOB, ["--engine.kv_cache_tokens", "null", "--eval.batch_size", "100", "--data.max_prompt_tokens", "100"])
    assert wider.engine.kv_job_tokens == 100 * (100 + 64 + 16)
    assert load_config(MAIN_JOB, ["--data.max_prompt_tokens", "null"]).engine.kv_job_tokens is None  # unbounded prompts
    args = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=8)
    kv = KVCache.for_model(args, EngineConfig(kv_job_tokens=cfg.engine.kv_job_tokens), torch.float32, torch.device("cpu"))
    assert kv.capacity_tokens == 64 * (256 + 64 + 16)  # far below 30% of this machine's free memory
    assert KVCache.for_model(args, EngineConfig(kv_cache_tokens=4096, kv_job_tokens=1024), torch.float32, "cpu").capacity_tokens == 4096
    free_share = KVCache.for_model(args, EngineConfig(), torch.float32, torch.device("cpu")).capacity_tokens
    assert free_share > 10 * kv.capacity_tokens  # no bound: kv_memory_fraction of free memory


def test_a_colocated_trainer_turn_holds_neither_packed_nor_spare_engine_weights(tiny_model_dir):
    """Released for a trainer's turn, the CPU engine drops its packed weight copies and its KV pools;
    a weight update committed meanwhile keeps no retired weights as spare buffers and re-packs; a
    resume without an update re-packs too; greedy output is what it was before the cycle."""
    from noria.config import EngineConfig
    from noria.engine import Engine
    from noria.engine.protocol import GenerateRequest, SamplingParams
    from noria.models import load_model

    engine = Engine(load_model(tiny_model_dir, dtype=torch.bfloat16), None, EngineConfig(kv_cache_tokens=256, block_size=4))
    try:
        if engine.runner.fast is None:
            import pytest

            pytest.skip("no oneDNN-packed fast decoder for bf16 on this CPU")
        request = GenerateRequest(input_ids=[5, 9, 17, 33], sampling=SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
        expected = engine.generate_batch([request])[0].output_ids
        engine.runner.fast.wait_packed()
        assert engine.runner.fast.packed is not None
        for update in (False, True):
            engine.release_memory_occupation()
            assert engine.memory_released and engine.runner.fast.packed is None
            if update:  # the colocated sync: the same weights, committed as version 1
                state = {n: t.detach().float().clone() for n, t in engine.model.state_dict().items() if n != "lm_head.weight"}
                engine.weights.stage(state, "u1")
                engine.weights.commit("u1", 1)
                assert engine.weights.stage_area._spare == {}  # no retired copy kept while released
            engine.resume_memory_occupation()
            engine.runner.fast.wait_packed()
            assert engine.runner.fast.packed is not None, f"not re-packed (update={update})"
            assert engine.generate_batch([request])[0].output_ids == expected
    finally:
        engine.shutdown(1)


def test_a_trainer_turn_may_free_the_engine_weights_which_only_a_full_update_brings_back(tiny_model_dir):
    """``release_memory_occupation(weights=True)`` (a colocated trainer's turn with a full sync): the
    live weights are freed; an update missing a tensor is refused and changes nothing, a resume before
    a full update is refused; the full update commits and the engine generates what it did before."""
    import pytest

    from noria.config import EngineConfig
    from noria.engine import Engine
    from noria.engine.protocol import GenerateRequest, SamplingParams
    from noria.engine.weights import WeightUpdateError
    from noria.models import load_model

    engine = Engine(load_model(tiny_model_dir, dtype=torch.float32), None, EngineConfig(kv_cache_tokens=256, block_size=4))
    try:
        request = GenerateRequest(input_ids=[5, 9, 17, 33], sampling=SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
        expected = engine.generate_batch([request])[0].output_ids
        state = {n: t.detach().clone() for n, t in engine.model.state_dict().items() if n != "lm_head.weight"}
        specs = engine.weights.specs()
        engine.release_memory_occupation(weights=True)
        assert all(p.numel() == 0 for p in engine.model.parameters())
        assert engine.weights.specs() == specs  # what an update may name is unchanged
        with pytest.raises(WeightUpdateError, match="released"):
            engine.weights.checksums()
        last = sorted(state)[-1]
        engine.weights.stage({n: t for n, t in state.items() if n != last}, "partial")
        with pytest.raises(WeightUpdateError, match=f"every one must come; missing '{last}'"):
            engine.weights.commit("partial", 1)
        assert engine.weights.version == 0 and all(p.numel() == 0 for p in engine.model.parameters())
        with pytest.raises(WeightUpdateError, match="no full update"):
            engine.resume_memory_occupation()
        engine.weights.discard()
        engine.weights.stage(state, "full")
        engine.weights.commit("full", 1)
        assert engine.weights.stage_area._spare == {} and engine.weights.specs() == specs
        engine.resume_memory_occupation()
        assert engine.generate_batch([request])[0].output_ids == expected
        engine.release_memory_occupation()  # the KV cache alone: the weights stay
        assert all(p.numel() > 0 for p in engine.model.parameters())
        engine.resume_memory_occupation()
    finally:
        engine.shutdown(1)


def test_onednn_cache_bound_sets_both_caches_unless_the_environment_does(monkeypatch):
    from noria.train.memory import ONEDNN_CACHE_ENV, bound_onednn_cache

    for key in ONEDNN_CACHE_ENV:
        monkeypatch.delenv(key, raising=False)
    assert not bound_onednn_cache(None) and not any(k in os.environ for k in ONEDNN_CACHE_ENV)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "500")  # set by the user: kept
    assert bound_onednn_cache(64)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64" and os.environ["LRU_CACHE_CAPACITY"] == "500"
    assert not bound_onednn_cache(8)  # both set now
    assert load_config(MAIN_JOB).train.onednn_cache_capacity == 64


def test_noria_serve_bounds_its_onednn_caches_and_refuses_a_bad_bound(tiny_model_dir):
    import subprocess
    import sys

    from noria.engine.server import load_serve_config

    assert load_serve_config(str(tiny_model_dir), [], None, None).engine.onednn_cache_capacity == 64
    assert load_serve_config(str(tiny_model_dir), ["--engine.onednn_cache_capacity", "null"], None, None).engine.onednn_cache_capacity is None
    bad = subprocess.run([sys.executable, "-m", "noria", "serve", "--model", str(tiny_model_dir), "--port", "0",
                          "--engine.onednn_cache_capacity", "0"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode != 0 and "engine.onednn_cache_capacity must be >= 1" in bad.stderr
