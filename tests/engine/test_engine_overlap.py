"""``engine.overlap``: the next decode step is launched before the current one's tokens are on the
host (``Scheduler.follow``, ``Engine._follow``). On CPU every step runs on the host, so ``on`` only
reorders work; these tests pin what must not change: the tokens, their logprobs and versions, stop
and length finishes, block accounting, aborts and updates arriving mid-run. The device feed of the
CUDA graphs is tested in tests/engine/test_engine_cuda.py.
"""

from __future__ import annotations

import pytest
import torch

from engine_util import greedy, prompt, reference, submit, wait_until
from noria.config import EngineConfig
from noria.engine import Engine, GenerateRequest, SamplingParams
from noria.engine.kv_cache import KVCache
from noria.engine.radix import RadixCache
from noria.engine.scheduler import Chunk, Req, Scheduler, StopChecker


def engine_with(model, tokenizer, overlap: str, **overrides) -> Engine:
    settings = dict(kv_cache_tokens=2048, block_size=4, chunked_prefill_size=8, max_batch_tokens=64,
                    attention="torch", prefix_cache=False, overlap=overlap)
    settings.update(overrides)
    return Engine(model, tokenizer, EngineConfig(**settings))


def sampled(n_new: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=n_new, ignore_eos=True, seed=5, **kw)


def mixed_requests(stop_id: int) -> list[GenerateRequest]:
    """Lengths that end on different steps, a stop token that ends a request early (its overlapped
    next step is dropped) and a seeded sampled request."""
    reqs = [GenerateRequest(input_ids=prompt(5 + 3 * i, i), sampling=greedy(n)) for i, n in enumerate((4, 9, 17, 23))]
    reqs.append(GenerateRequest(input_ids=prompt(9), sampling=sampled(20, stop_token_ids=[stop_id])))
    reqs.append(GenerateRequest(input_ids=prompt(11, 7), sampling=sampled(15)))
    return reqs


def greedy_reference(model, ids: list[int], n_new: int) -> list[int]:
    return reference(model, ids, n_new)[0]


def test_overlap_changes_no_token_logprob_or_finish(model, tokenizer):
    # The stop token: the seeded request's 7th sampled token, where it first appears (the tiny
    # model's greedy outputs repeat one token).
    engine = engine_with(model, tokenizer, "off")
    free_run = engine.generate_batch([GenerateRequest(input_ids=prompt(9), sampling=sampled(20))])[0].output_ids
    engine.shutdown(1)
    cut = next(i for i in range(5, 20) if free_run[i] not in free_run[:i])
    stop_id = free_run[cut]
    results = {}
    for overlap in ("off", "on"):
        engine = engine_with(model, tokenizer, overlap)
        reqs = mixed_requests(stop_id)
        parts: list = []  # the stopped request streams: no part may follow its finished one
        futures = [submit(engine, r) for r in reqs[:4]]
        engine.submit(reqs[4], parts.append, stream=True)
        futures.append(submit(engine, reqs[5]))
        outs = [f.result(timeout=120) for f in futures]
        wait_until(lambda: parts and parts[-1].finished)
        metrics = engine.metrics()
        assert [p.finished for p in parts] == [False] * (len(parts) - 1) + [True]
        outs.insert(4, parts[-1])
        assert engine.kv.allocator.num_free_blocks == engine.kv.num_blocks  # dropped steps leak nothing
        engine.shutdown(1)
        results[overlap] = (outs, metrics)
    (off, m_off), (on, m_on) = results["off"], results["on"]
    assert m_off["overlapped_steps"] == 0 and m_on["overlapped_steps"] > 10
    assert m_on["generated_tokens"] == m_off["generated_tokens"] == sum(len(o.output_ids) for o in on)
    for a, b in zip(off, on):
        assert b.output_ids == a.output_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
        assert b.finish_reason == a.finish_reason and b.weight_versions == a.weight_versions
    stopped = on[4]
    assert stopped.finish_reason == {"type": "stop", "matched": stop_id} and stopped.output_ids == free_run[: cut + 1]
    assert [len(o.output_ids) for o in on[:4]] == [4, 9, 17, 23]
    assert on[0].output_ids == greedy_reference(model, prompt(5, 0), 4)


def test_overlap_with_top_logprobs_and_a_tiny_cache(model, tokenizer):
    """Host-sampled steps (top logprobs) and a cache too small to allocate ahead (``follow`` gives
    up, the scheduler retracts): the same outputs as without overlap."""
    reqs = [GenerateRequest(input_ids=prompt(n, n), sampling=greedy(30), top_logprobs_num=2) for n in (20, 25, 30, 12)]
    outs = {}
    for overlap in ("off", "on"):
        engine = engine_with(model, tokenizer, overlap, kv_cache_tokens=96)
        outs[overlap] = engine.generate_batch(reqs, timeout_s=120)
        assert engine.metrics()["retractions"] > 0
        assert engine.kv.allocator.num_free_blocks == engine.kv.num_blocks
        engine.shutdown(1)
    for a, b in zip(outs["off"], outs["on"]):
        assert b.output_ids == a.output_ids and b.top_logprobs is not None and len(b.top_logprobs) == 30


def test_overlap_lets_updates_aborts_and_new_requests_in_between_steps(model, tokenizer):
    engine = engine_with(model, tokenizer, "on", max_running_requests=4)
    long = GenerateRequest(input_ids=prompt(10), sampling=greedy(300), rid="long")
    other = GenerateRequest(input_ids=prompt(8, 3), sampling=greedy(60), rid="other")
    futures = [submit(engine, long), submit(engine, other)]
    wait_until(lambda: engine.metrics()["generated_tokens"] >= 10)
    engine.weights.update_from_state_dict(dict(model.state_dict()), version=1)  # the same weights, version 1
    late = GenerateRequest(input_ids=prompt(6, 4), sampling=greedy(5))
    futures.append(submit(engine, late))
    out_other, out_late = futures[1].result(timeout=60), futures[2].result(timeout=60)
    engine.abort("long")
    out_long = futures[0].result(timeout=60)
    for out in (out_other, out_long):
        v = out.weight_versions
        assert v == sorted(v) and v[0] == 0 and v[-1] == 1  # one switch, between two steps
    assert out_other.output_ids == greedy_reference(model, other.input_ids, 60)
    assert out_late.output_ids == greedy_reference(model, late.input_ids, 5) and set(out_late.weight_versions) == {1}
    assert out_long.finish_reason["type"] == "abort" and len(out_long.output_ids) < 300
    wait_until(lambda: engine.kv.allocator.num_free_blocks == engine.kv.num_blocks)
    assert engine.metrics()["overlapped_steps"] > 0
    engine.shutdown(1)


def test_follow_schedules_what_schedule_would_after_the_step():
    config = EngineConfig(kv_cache_tokens=64, block_size=4, chunked_prefill_size=8, max_batch_tokens=64)
    kv = KVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=16, block_size=4, dtype=torch.float32,
                 device=torch.device("cpu"))
    sched = Scheduler(config, kv, RadixCache(kv.allocator, 4, enabled=False), StopChecker(set(), None))

    def req(n_prompt: int, max_new: int) -> Req:
        r = Req(GenerateRequest(input_ids=list(range(3, 3 + n_prompt)), sampling=greedy(max_new)), lambda o: None,
                False, max_total_tokens=n_prompt + max_new)
        sched.add(r)
        return r

    a, b = req(3, 10), req(4, 2)
    sched.process(sched.schedule(), [7, 8], [0.0, 0.0], None, 0)  # prefill both; each sampled 1 token
    step = sched.schedule()
    assert [(c.req, c.start) for c in step] == [(a, 3), (b, 4)]
    follow = sched.follow(step)
    # b's token of this step is its 2nd = max_new_tokens: it finishes, so only a continues, at 4,
    # with the block for position 4 allocated ahead (a had one block for positions 0..3).
    assert [(row, c.req, c.start, c.pending) for row, c in follow] == [(0, a, 4, True)]
    assert len(a.block_table) == 2
    sched.process(step, [9, 2], [0.0, 0.0], None, 0)
    assert b.finish_reason == {"type": "length", "length": 2}
    assert [(c.req, c.start) for c in sched.schedule()] == [(a, 4)]  # what follow returned
    sched.add(Req(GenerateRequest(input_ids=[5, 6], sampling=greedy(3)), lambda o: None, False, 5))
    assert sched.follow([Chunk(a, 5, 1)]) is None  # a request waits: the next step admits it
