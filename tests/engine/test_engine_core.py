"""The engine against a no-cache reference: batching, chunking, prefix cache, memory pressure, control.

CPU only, tiny random Llama from the ``tiny_model_dir`` fixture. The reference is greedy decoding
with the native model's full forward (no KV cache) token by token, in fp32.
"""

from __future__ import annotations

import asyncio

import pytest

from engine_util import greedy, prompt, reference, submit, wait_until
from noria.config import EngineConfig
from noria.engine import Engine, GenerateRequest, RequestError, SamplingParams


def make_engine(model, tokenizer, **overrides) -> Engine:
    settings = dict(kv_cache_tokens=2048, block_size=4, chunked_prefill_size=8, max_batch_tokens=64, attention="torch")
    settings.update(overrides)
    return Engine(model, tokenizer, EngineConfig(**settings))


def check_reference(model, req: GenerateRequest, out) -> None:
    ref_ids, ref_lps = reference(model, req.input_ids, req.sampling.max_new_tokens)
    assert out.output_ids == ref_ids
    assert max(abs(a - b) for a, b in zip(out.logprobs, ref_lps)) < 1e-4


def test_greedy_batch_with_late_joiners_matches_reference(model, tokenizer):
    engine = make_engine(model, tokenizer)
    first = [GenerateRequest(input_ids=prompt(n, n), sampling=greedy(20)) for n in (3, 9)]
    late = [GenerateRequest(input_ids=prompt(n, n), sampling=greedy()) for n in (21, 40, 1)]
    futures = [submit(engine, r) for r in first]
    wait_until(lambda: engine.metrics()["generated_tokens"] >= 4)
    futures += [submit(engine, r) for r in late]
    outs = [f.result(timeout=60) for f in futures]
    for req, out in zip(first + late, outs):
        check_reference(model, req, out)
        assert out.finish_reason == {"type": "length", "length": req.sampling.max_new_tokens}
        assert out.weight_versions == [0] * len(out.output_ids)
    engine.shutdown(1)


def test_chunked_prefill_equals_unchunked(model, tokenizer):
    req = GenerateRequest(input_ids=prompt(45), sampling=greedy())
    chunked = make_engine(model, tokenizer, chunked_prefill_size=8)
    whole = make_engine(model, tokenizer, chunked_prefill_size=64)
    a, b = chunked.generate_batch([req])[0], whole.generate_batch([req])[0]
    assert a.output_ids == b.output_ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    chunked.shutdown(1)
    whole.shutdown(1)


def test_prefix_cache_hit_reports_cached_tokens_and_same_output(model, tokenizer):
    engine = make_engine(model, tokenizer)
    shared = prompt(26)
    first = GenerateRequest(input_ids=shared + [5, 6], sampling=greedy())
    second = GenerateRequest(input_ids=shared + [7, 8, 9], sampling=greedy())
    out1 = engine.generate_batch([first])[0]
    out2 = engine.generate_batch([second])[0]
    assert out1.cached_tokens == 0
    assert out2.cached_tokens == 26  # the shared 26 tokens, the last 2 inside a block (token granularity)
    check_reference(model, second, out2)
    assert engine.metrics()["prefix_hit_rate"] > 0
    # A repeat of a whole prompt still recomputes its last token (its logits are needed).
    again = engine.generate_batch([first])[0]
    assert again.cached_tokens == 27 and again.output_ids == out1.output_ids
    engine.shutdown(1)


def test_lru_eviction_under_a_tiny_cache(model, tokenizer):
    engine = make_engine(model, tokenizer, kv_cache_tokens=64)
    reqs = [GenerateRequest(input_ids=prompt(30, s), sampling=greedy(8)) for s in range(4)]
    for req in reqs:
        check_reference(model, req, engine.generate_batch([req])[0])
    metrics = engine.metrics()
    assert metrics["evictions"] > 0
    assert engine.kv.allocator.num_free_blocks + engine.radix.num_cached_blocks == engine.kv.num_blocks
    engine.shutdown(1)


def test_retraction_under_a_tiny_cache_keeps_reference_outputs(model, tokenizer):
    engine = make_engine(model, tokenizer, kv_cache_tokens=96, prefix_cache=False)
    reqs = [GenerateRequest(input_ids=prompt(n, n), sampling=greedy(30)) for n in (20, 25, 30, 12)]
    outs = engine.generate_batch(reqs, timeout_s=120)
    assert engine.metrics()["retractions"] > 0
    for req, out in zip(reqs, outs):
        check_reference(model, req, out)
        assert len(out.weight_versions) == 30
    assert engine.kv.allocator.num_free_blocks == engine.kv.num_blocks
    engine.shutdown(1)


def test_abort_running_and_waiting_frees_blocks(model, tokenizer):
    engine = make_engine(model, tokenizer, max_running_requests=1, prefix_cache=False)
    running = submit(engine, GenerateRequest(input_ids=prompt(10), sampling=greedy(400), rid="long"))
    waiting = submit(engine, GenerateRequest(input_ids=prompt(10, 1), sampling=greedy(5), rid="queued"))
    wait_until(lambda: engine.metrics()["generated_tokens"] >= 3)
    engine.abort("queued")
    engine.abort("long")
    out_long, out_queued = running.result(timeout=30), waiting.result(timeout=30)
    assert out_long.finish_reason["type"] == "abort" and 0 < len(out_long.output_ids) < 400
    assert out_queued.finish_reason["type"] == "abort" and out_queued.output_ids == []
    wait_until(lambda: engine.kv.allocator.num_free_blocks == engine.kv.num_blocks)
    engine.shutdown(1)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_and_resume_completes_requests(model, tokenizer, mode):
    engine = make_engine(model, tokenizer)
    req = GenerateRequest(input_ids=prompt(11), sampling=greedy(40))

    async def run():
        task = asyncio.ensure_future(engine.generate(req))
        while engine.metrics()["generated_tokens"] < 3:
            await asyncio.sleep(0.005)
        await engine.pause(mode)
        paused_at = engine.metrics()["generated_tokens"]
        load = engine.get_load()
        await asyncio.sleep(0.1)
        assert engine.metrics()["generated_tokens"] == paused_at  # nothing runs while paused
        await engine.resume()
        return load, await task

    load, out = asyncio.run(run())
    if mode == "retract":
        assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 1
    else:
        assert load["num_running_reqs"] == 1 and load["kv_usage"] > 0
    check_reference(model, req, out)
    engine.shutdown(1)


def test_finish_reasons_stop_ids_strings_eos_and_length(model, tokenizer):
    base = prompt(9)
    ref, _ = reference(model, base, 16)
    stop_id = ref[5]
    engine = make_engine(model, tokenizer, prefix_cache=False)
    out = engine.generate_batch([GenerateRequest(input_ids=base, sampling=greedy(16, stop_token_ids=[stop_id]))])[0]
    cut = ref.index(stop_id) + 1
    assert out.output_ids == ref[:cut] and out.finish_reason == {"type": "stop", "matched": stop_id}

    text = tokenizer.decode(ref, skip_special_tokens=True)
    stop = text[len(text) // 2 :][:3]
    out = engine.generate_batch([GenerateRequest(input_ids=base, sampling=greedy(16, stop=[stop]))])[0]
    assert out.finish_reason == {"type": "stop", "matched": stop}
    assert stop in tokenizer.decode(out.output_ids) and stop not in tokenizer.decode(out.output_ids[:-1])
    assert out.output_ids == ref[: len(out.output_ids)] and out.text == tokenizer.decode(out.output_ids)

    out = engine.generate_batch([GenerateRequest(input_ids=base, sampling=greedy(0))])[0]
    assert out.output_ids == [] and out.finish_reason == {"type": "length", "length": 0}
    engine.shutdown(1)

    eos_engine = Engine(model, tokenizer, EngineConfig(kv_cache_tokens=512, attention="torch"), eos_token_ids=[ref[3]])
    params = SamplingParams(temperature=0, max_new_tokens=16)
    out = eos_engine.generate_batch([GenerateRequest(input_ids=base, sampling=params)])[0]
    assert out.output_ids == ref[: ref.index(ref[3]) + 1]
    assert out.finish_reason == {"type": "stop", "matched": ref[3]}
    out = eos_engine.generate_batch([GenerateRequest(input_ids=base, sampling=greedy(16))])[0]  # ignore_eos
    assert out.output_ids == ref and out.finish_reason == {"type": "length", "length": 16}
    eos_engine.shutdown(1)


def test_seeded_sampling_does_not_depend_on_the_batch(model, tokenizer):
    engine = make_engine(model, tokenizer)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_new_tokens=16, ignore_eos=True, seed=123)
    mine = GenerateRequest(input_ids=prompt(13), sampling=params)
    alone = engine.generate_batch([mine])[0]
    others = [
        GenerateRequest(input_ids=prompt(5 + s, s), sampling=SamplingParams(temperature=1.0, max_new_tokens=10 + s))
        for s in range(5)
    ]
    batched = engine.generate_batch(others[:3] + [mine] + others[3:])[3]
    assert batched.output_ids == alone.output_ids
    assert batched.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    reseeded = dataclass_replace_seed(mine, 124)
    assert engine.generate_batch([reseeded])[0].output_ids != alone.output_ids
    engine.shutdown(1)


def dataclass_replace_seed(req: GenerateRequest, seed: int) -> GenerateRequest:
    import dataclasses

    return dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, seed=seed))


def test_top_logprobs(model, tokenizer):
    engine = make_engine(model, tokenizer)
    req = GenerateRequest(input_ids=prompt(7), sampling=greedy(6), top_logprobs_num=5)
    out = engine.generate_batch([req])[0]
    assert len(out.top_logprobs) == 6
    for token, lp, top in zip(out.output_ids, out.logprobs, out.top_logprobs):
        assert len(top) == 5 and top[0] == (token, pytest.approx(lp))
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert "output_top_logprobs" in out.meta_info()
    engine.shutdown(1)


def test_stream_yields_growing_partials(model, tokenizer):
    engine = make_engine(model, tokenizer)
    req = GenerateRequest(input_ids=prompt(6), sampling=greedy(5))

    async def collect():
        return [part async for part in engine.stream(req)]

    parts = asyncio.run(collect())
    assert [len(p.output_ids) for p in parts] == [1, 2, 3, 4, 5]
    assert parts[-1].finished and not any(p.finished for p in parts[:-1])
    check_reference(model, req, parts[-1])
    engine.shutdown(1)


def test_rejects_requests_that_cannot_fit(model, tokenizer):
    engine = make_engine(model, tokenizer, kv_cache_tokens=64, max_context=100)
    with pytest.raises(RequestError, match="context limit"):
        engine.submit(GenerateRequest(input_ids=prompt(100), sampling=greedy()), print)
    with pytest.raises(RequestError, match="whole cache"):
        engine.submit(GenerateRequest(input_ids=prompt(50), sampling=greedy(40)), print)
    with pytest.raises(RequestError, match="input_ids"):
        engine.submit(GenerateRequest(input_ids=[10**6], sampling=greedy()), print)
    long_run = GenerateRequest(input_ids=prompt(4), sampling=greedy(50), rid="dup")
    engine.submit(long_run, lambda out: None)
    with pytest.raises(RequestError, match="already in flight"):
        engine.submit(long_run, print)
    fresh, twice = (GenerateRequest(input_ids=prompt(4), sampling=greedy(2), rid=r) for r in ("fresh", "twice"))
    for batch in ([fresh, long_run], [fresh, twice, twice]):  # all or none: "fresh" is never queued
        with pytest.raises(RequestError, match="already in flight"):
            engine.submit_many(batch, [print] * len(batch))
    assert engine.generate_batch([fresh], timeout_s=60)[0].finish_reason["type"] == "length"
    engine.shutdown(5)


def test_context_limit_finishes_with_length(model, tokenizer):
    engine = make_engine(model, tokenizer, max_context=20)
    out = engine.generate_batch([GenerateRequest(input_ids=prompt(15), sampling=greedy(100))])[0]
    assert len(out.output_ids) == 5 and out.finish_reason == {"type": "length", "length": 5}
    engine.shutdown(1)


def test_shutdown_aborts_what_does_not_drain(model, tokenizer):
    engine = make_engine(model, tokenizer)
    fut = submit(engine, GenerateRequest(input_ids=prompt(5), sampling=greedy(100_000 - 10)))
    engine.shutdown(drain_timeout_s=0.2)
    assert fut.result(timeout=5).finish_reason["type"] == "abort"
    with pytest.raises(RequestError, match="shutting down"):
        engine.submit(GenerateRequest(input_ids=prompt(5)), print)


def test_a_large_cpu_kv_cache_costs_no_resident_memory_until_its_blocks_are_written():
    """The pools are zero pages mapped on first touch (``zeroed_pools``): a 2 GB cache holds no
    memory of its own until blocks are written, and unwritten slots read 0 (reading maps the
    kernel's shared zero page). Counted over the pools' own pages (/proc/self/pagemap), not the
    process's resident memory, which another thread's allocations or a freed temporary kept by the
    C heap also move."""
    import torch

    from noria.engine.kv_cache import KVCache

    kv = KVCache(num_layers=4, num_blocks=2**15, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16, device="cpu")
    pools = kv.k_pools + kv.v_pools
    total = sum(p.numel() * p.element_size() for p in pools)
    assert total == 2**31 and sum(_own_pages(p) for p in pools) == 0
    kv.k_pools[0][:16] = 1.0  # one block of one layer written
    assert kv.k_pools[0][:16].float().sum().item() == 16 * 4 * 64 and kv.k_pools[0][16:].abs().sum().item() == 0
    assert kv.v_pools[3].dtype == torch.bfloat16 and kv.v_pools[3].shape == (2**19, 4, 64)
    assert 1 <= sum(_own_pages(p) for p in pools) <= 2  # the written block's page, after reading every slot


def _own_pages(tensor) -> int:
    """Pages under ``tensor`` that hold memory of this process: present and mapped by it alone
    (/proc/self/pagemap bits 63 and 56; the shared zero page is present but not exclusive)."""
    import mmap
    import struct

    page = mmap.PAGESIZE
    first = tensor.data_ptr() // page
    last = (tensor.data_ptr() + tensor.numel() * tensor.element_size() - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first + 1) * 8)
    own = (1 << 63) | (1 << 56)
    return sum(1 for (entry,) in struct.iter_unpack("<Q", raw) if entry & own == own)
