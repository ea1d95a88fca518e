"""The token-granular prefix cache: matches that end inside a KV block, generated tokens cached for
the next turn, reference counts, eviction, flushes, weight updates and deterministic exactness.

CPU only: the radix tree on its own, then the engine on the tiny random Llama (fixtures of
tests/engine/conftest.py) against the no-cache reference decode.
"""

from __future__ import annotations

import functools

import pytest
import torch

from engine_util import greedy, prompt, reference
from noria.config import EngineConfig
from noria.engine import Engine, GenerateRequest
from noria.engine.kv_cache import BlockAllocator
from noria.engine.radix import RadixCache
from noria.models import load_model

# ------------------------------------------------------------------------------ the tree


def _cache(num_blocks: int = 8, block_size: int = 4) -> RadixCache:
    return RadixCache(BlockAllocator(num_blocks), block_size)


def _insert(cache: RadixCache, tokens: list[int]) -> list[int]:
    """Cache ``tokens`` as a finished request would (its own blocks, released after)."""
    blocks = cache.allocator.allocate(-(-len(tokens) // cache.block_size))
    cache.insert(tokens, blocks, cache.epoch)
    cache.allocator.decref(blocks)
    return blocks


def test_match_ends_inside_a_block_of_a_partial_tail_or_of_a_full_block():
    cache = _cache()
    blocks = _insert(cache, [1, 2, 3, 4, 5, 6, 7])  # one full block, a tail of three
    assert cache.num_cached_blocks == 2
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 9, 9])
    assert (m.blocks, m.tokens, m.partial_block, m.partial_tokens, m.partial_fill) == ([blocks[0]], 6, blocks[1], 2, 3)
    assert cache.allocator.refcount(blocks[1]) == 2  # locked for the request until it copied
    cache.unlock(m)
    m = cache.match_prefix([1, 2, 9])  # the first tokens of a full block
    assert (m.blocks, m.tokens, m.partial_block, m.partial_tokens) == ([], 2, blocks[0], 2)
    cache.unlock(m)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).tokens == 6  # never the whole sequence
    assert all(cache.allocator.refcount(b) >= 1 for b in blocks)


def test_token_match_off_is_whole_blocks_only():
    cache = _cache()
    cache.token_match = False
    _insert(cache, [1, 2, 3, 4, 5, 6, 7])
    assert cache.num_cached_blocks == 1  # the tail is not cached
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 9])
    assert (m.tokens, m.partial_block) == (4, None)
    cache.unlock(m)


def test_a_longer_tail_replaces_the_one_it_extends_and_a_covered_one_is_not_added():
    cache = _cache()
    old = _insert(cache, [1, 2, 3, 4, 5])
    new = _insert(cache, [1, 2, 3, 4, 5, 6, 7])  # the next turn, its own blocks
    assert cache.num_cached_blocks == 2 and cache.allocator.num_free_blocks == 8 - 2
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert (m.blocks, m.partial_block, m.partial_tokens) == ([old[0]], new[1], 3)  # the first full copy stays
    cache.unlock(m)
    _insert(cache, [1, 2, 3, 4, 5, 6])  # covered by the tail [5, 6, 7]: nothing new
    assert cache.num_cached_blocks == 2 and cache.allocator.num_free_blocks == 6
    _insert(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # a full block [5..8] covers the tail
    assert cache.num_cached_blocks == 3 and cache.allocator.num_free_blocks == 5


def test_eviction_spares_blocks_a_request_holds_and_flush_drops_tails():
    cache = _cache(num_blocks=6)
    _insert(cache, [1, 2, 3, 4, 5, 6])
    _insert(cache, [7, 7, 7, 7, 8, 8])
    held = cache.match_prefix([1, 2, 3, 4, 5, 6, 0])  # a running request reads [1..4] and [5, 6]
    assert held.partial_tokens == 2
    assert cache.evict(10) == 2  # [8, 8] then its parent [7, 7, 7, 7]; both held blocks stay
    assert cache.num_cached_blocks == 2
    cache.unlock(held)
    assert cache.evict(10) == 2 and cache.allocator.num_free_blocks == 6
    _insert(cache, [1, 2, 3, 4, 5])
    old_epoch = cache.epoch
    assert cache.flush() == 2 and cache.num_cached_blocks == 0
    blocks = cache.allocator.allocate(2)
    cache.insert([1, 2, 3, 4, 5], blocks, old_epoch)  # KV of the old epoch is never cached
    cache.allocator.decref(blocks)
    assert cache.num_cached_blocks == 0 and cache.allocator.num_free_blocks == 6


# ------------------------------------------------------------------------------ the engine


def _engine(model, **overrides) -> Engine:
    settings = dict(kv_cache_tokens=2048, block_size=4, chunked_prefill_size=8, max_batch_tokens=64, attention="torch")
    settings.update(overrides)
    return Engine(model, None, EngineConfig(**settings))


def _next_turn(req: GenerateRequest, out, appended: list[int]) -> list[int]:
    return list(req.input_ids) + list(out.output_ids) + appended


@pytest.mark.parametrize("reuse", ["copy", "share"])
def test_second_turn_reuses_the_first_turns_tail_and_matches_the_reference(model, reuse):
    engine = _engine(model)
    engine.scheduler.partial_reuse = reuse
    first = GenerateRequest(input_ids=prompt(9), sampling=greedy(7))  # 15 tokens computed: a tail of 3
    out1 = engine.generate_batch([first])[0]
    second = GenerateRequest(input_ids=_next_turn(first, out1, [9, 8, 7]), sampling=greedy(6))
    third_ids = second.input_ids[:14] + [4, 4, 4]  # ends inside the block the second turn extended
    out2 = engine.generate_batch([second])[0]
    assert out2.cached_tokens == 9 + 7 - 1  # every computed token of the first turn, generated ones included
    out3 = engine.generate_batch([GenerateRequest(input_ids=third_ids, sampling=greedy(5))])[0]
    assert out3.cached_tokens == 14
    for ids, out in ((second.input_ids, out2), (third_ids, out3)):
        ref_ids, ref_lps = reference(model, ids, len(out.output_ids))
        assert out.output_ids == ref_ids
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref_lps)) < 1e-4
    engine.shutdown(1)
    alloc = engine.kv.allocator
    assert alloc.num_free_blocks + engine.radix.num_cached_blocks == engine.kv.num_blocks  # no leak


@pytest.mark.parametrize("reuse", ["copy", "share"])
def test_multi_turn_sessions_under_a_tiny_cache_evict_correctly(model, reuse):
    # Four sessions of three turns at once in room for ~3 conversations: eviction and retraction
    # run while requests read copied, shared and cached blocks; outputs stay the reference's.
    engine = _engine(model, kv_cache_tokens=96, max_running_requests=4)
    engine.scheduler.partial_reuse = reuse
    reqs = [GenerateRequest(input_ids=prompt(9 + s, s), sampling=greedy(5)) for s in range(4)]
    for turn in range(3):
        outs = engine.generate_batch(reqs, timeout_s=120)
        for req, out in zip(reqs, outs):
            ref_ids, ref_lps = reference(model, req.input_ids, 5)
            assert out.output_ids == ref_ids
            assert max(abs(a - b) for a, b in zip(out.logprobs, ref_lps)) < 1e-4
        reqs = [GenerateRequest(input_ids=_next_turn(r, o, [11 + turn, 5]), sampling=greedy(5)) for r, o in zip(reqs, outs)]
    m = engine.metrics()
    assert m["evictions"] > 0 and m["prefix_cached_tokens"] > 0
    assert engine.kv.allocator.num_free_blocks + engine.radix.num_cached_blocks == engine.kv.num_blocks
    assert not engine.scheduler._appending  # no block is left claimed by a finished request
    engine.shutdown(1)


def test_a_cpu_prefix_cache_past_its_share_reuses_its_own_blocks_before_writing_fresh_ones(model):
    """``engine.prefix_cache_share``: one-off prompts, one after another, leave their KV in the prefix
    cache. Unbounded, the cache keeps them until the (lazily mapped) pool is full: every block gets
    written. At a quarter, a request takes the cache's oldest blocks once the cache holds a quarter
    of the pool, so the blocks ever written stay near what runs plus that quarter; a prompt seen
    just before is still matched, and outputs are the reference's."""
    written = {}
    for share in (1.0, 0.25):
        engine = _engine(model, kv_cache_tokens=512, prefix_cache_share=share)  # 128 blocks of 4 tokens
        alloc = engine.kv.allocator
        reqs = [GenerateRequest(input_ids=prompt(20, seed), sampling=greedy(4)) for seed in range(30)]  # 6 blocks each
        for req in reqs:
            out = engine.generate_batch([req])[0]
            assert out.output_ids == reference(model, req.input_ids, 4)[0]
        again = engine.generate_batch([GenerateRequest(input_ids=reqs[-1].input_ids + [7], sampling=greedy(2))])[0]
        assert again.cached_tokens >= 20  # the newest prompt and answer stay cached
        written[share] = alloc._fresh
        if share < 1:
            assert engine.radix.num_cached_blocks <= 32 + 6 and engine.metrics()["evictions"] > 0
        assert alloc.num_free_blocks + engine.radix.num_cached_blocks == engine.kv.num_blocks  # no leak
        engine.shutdown(1)
    assert written[1.0] == 128 and written[0.25] <= 32 + 2 * 6, written


def test_flush_and_weight_update_clear_partial_tails(model):
    engine = _engine(model)
    first = GenerateRequest(input_ids=prompt(9), sampling=greedy(3))
    out1 = engine.generate_batch([first])[0]
    again = GenerateRequest(input_ids=_next_turn(first, out1, [2]), sampling=greedy(3))
    assert engine.generate_batch([again])[0].cached_tokens == 11
    assert engine.flush_cache() > 0 and engine.metrics()["cached_blocks"] == 0
    assert engine.generate_batch([again])[0].cached_tokens == 0
    assert engine.generate_batch([again])[0].cached_tokens == len(again.input_ids) - 1  # cached again
    scaled = {n: t * 1.5 for n, t in model.state_dict().items() if "layers.0.mlp" in n}
    engine.weights.update_from_state_dict(scaled, version=1)
    after = engine.generate_batch([again])[0]
    assert after.cached_tokens == 0 and after.weight_versions == [1] * 3  # new weights never read old KV
    engine.shutdown(1)


def test_metrics_count_prompt_and_cached_tokens(model):
    engine = _engine(model)
    first = GenerateRequest(input_ids=prompt(6), sampling=greedy(2))
    out = engine.generate_batch([first])[0]
    engine.generate_batch([GenerateRequest(input_ids=_next_turn(first, out, [3]), sampling=greedy(2))])
    m = engine.metrics()
    assert (m["prefix_prompt_tokens"], m["prefix_cached_tokens"]) == (6 + 9, 7)
    assert m["prefix_hit_rate"] == pytest.approx(7 / 15)
    engine.shutdown(1)


def test_the_step_line_shows_each_steps_own_prefix_share(model):
    """``engine/prefix_hit_rate`` in metrics.jsonl is the share of the tokens admitted since the last
    line (the engine keeps running totals): a step without traffic shows 0, not the history."""
    from types import SimpleNamespace

    from noria.launch.job import LocalJob

    engine = _engine(model)
    job = SimpleNamespace(local_engine=engine, engine_seen={})
    line = functools.partial(LocalJob.engine_metrics, job)
    first = GenerateRequest(input_ids=prompt(6), sampling=greedy(2))
    out = engine.generate_batch([first])[0]
    assert line()["engine/prefix_hit_rate"] == 0.0  # step 1: 6 prompt tokens, none cached
    engine.generate_batch([GenerateRequest(input_ids=_next_turn(first, out, [3]), sampling=greedy(2))])
    assert line()["engine/prefix_hit_rate"] == pytest.approx(7 / 9)  # step 2 alone, not 7/15 since start
    assert line()["engine/prefix_hit_rate"] == 0.0  # nothing admitted since
    engine.shutdown(1)


def test_a_groups_samples_submitted_together_prefill_their_prompt_once(model):
    """Two groups of eight samples, submitted at once as a rollout step does, whose prompts share
    their first 12 tokens: one request computes each block once and the others wait a step for it
    (in-batch prefix caching). Before, all sixteen prefilled from scratch: a block reaches the cache
    only when a request ends."""
    engine = _engine(model)  # blocks of 4, prefill chunks of 8
    shared = prompt(12, 5)
    a, b = shared + prompt(10, 1), shared + prompt(10, 2)
    reqs = [GenerateRequest(input_ids=ids, sampling=greedy(5)) for ids in (a, b) for _ in range(8)]
    outs = engine.generate_batch(reqs, timeout_s=120)
    cached = [o.cached_tokens for o in outs]
    assert sorted(cached[:8]) == [0] + [20] * 7, cached  # a's five full blocks, computed by its first request
    assert sorted(cached[8:]) == [12] + [20] * 7, cached  # b's first request reuses the 12 tokens a computed
    for ids, group in ((a, outs[:8]), (b, outs[8:])):
        ref_ids, ref_lps = reference(model, ids, 5)
        for out in group:
            assert out.output_ids == ref_ids
            assert max(abs(x - y) for x, y in zip(out.logprobs, ref_lps)) < 1e-4
    engine.shutdown(1)
    assert engine.kv.allocator.num_free_blocks + engine.radix.num_cached_blocks == engine.kv.num_blocks  # no leak


def test_requests_for_a_cached_prompt_are_admitted_together_not_one_per_step(model):
    """Nothing is left to wait for once a prompt is cached up to its last token (the one every request
    recomputes): 32 such requests take the steps of one batch. (The first version of the in-batch
    deferral made each wait for the one admitted before it: one admission per step.)"""
    engine = _engine(model, max_batch_tokens=256)
    ids = prompt(16, 3)  # four full blocks: the last one is never wholly matched
    engine.generate_batch([GenerateRequest(input_ids=ids, sampling=greedy(1))])
    before = engine.metrics()["steps"]
    outs = engine.generate_batch([GenerateRequest(input_ids=ids, sampling=greedy(4)) for _ in range(32)], timeout_s=120)
    assert [o.cached_tokens for o in outs] == [15] * 32
    assert engine.metrics()["steps"] - before <= 6, engine.metrics()["steps"] - before  # 4 tokens each, all side by side
    engine.shutdown(1)


@pytest.mark.parametrize("reuse", ["copy", "share"])
def test_deterministic_partial_reuse_is_bitwise_from_scratch(tiny_model_dir, reuse):
    # bf16, exact numerics: a turn served from a partly reused block (copied or shared), then
    # decoded, gives the logprobs of the same prompt computed on an engine without a prefix cache.
    model = load_model(tiny_model_dir, dtype=torch.bfloat16)
    settings = dict(block_size=16, chunked_prefill_size=8, max_batch_tokens=24, deterministic=True)
    cached = _engine(model, **settings)
    cached.scheduler.partial_reuse = reuse
    first = GenerateRequest(input_ids=prompt(21, 3), sampling=greedy(6))
    out1 = cached.generate_batch([first])[0]
    second = GenerateRequest(input_ids=_next_turn(first, out1, [17, 29, 31]), sampling=greedy(10))
    warm = cached.generate_batch([second])[0]
    assert warm.cached_tokens == 26 and warm.cached_tokens % 16 != 0  # the match ends inside a block
    scratch = _engine(model, **settings, prefix_cache=False)
    cold = scratch.generate_batch([second])[0]
    assert cold.cached_tokens == 0
    assert warm.output_ids == cold.output_ids
    assert warm.logprobs == cold.logprobs  # bitwise
    cached.shutdown(1)
    scratch.shutdown(1)
