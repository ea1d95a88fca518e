"""Engine parts on their own: block allocator, radix prefix cache, sampling, paged attention. CPU, fast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from noria.engine import attention_ref
from noria.engine.kv_cache import BlockAllocator, OutOfBlocks
from noria.engine.protocol import SamplingParams
from noria.engine.radix import RadixCache
from noria.engine.sampling import sample


def test_allocator_refcounts_and_free_list():
    alloc = BlockAllocator(4)
    a = alloc.allocate(3)
    assert alloc.num_free_blocks == 1
    alloc.incref(a[:1])
    alloc.decref(a)
    assert alloc.num_free_blocks == 3 and alloc.refcount(a[0]) == 1
    with pytest.raises(OutOfBlocks):
        alloc.allocate(4)
    assert alloc.num_free_blocks == 3  # a failed allocation takes nothing
    alloc.decref(a[:1])
    with pytest.raises(RuntimeError, match="double free"):
        alloc.decref(a[:1])


def _cache(num_blocks: int = 8, block_size: int = 2) -> RadixCache:
    return RadixCache(BlockAllocator(num_blocks), block_size)


def test_radix_match_insert_and_last_token_recomputed():
    cache = _cache()
    tokens = [1, 2, 3, 4, 5]
    blocks = cache.allocator.allocate(3)
    cache.insert(tokens, blocks, cache.epoch)  # two full blocks and the partial third cached
    cache.allocator.decref(blocks)
    assert cache.num_cached_blocks == 3 and cache.allocator.num_free_blocks == 5
    match = cache.match_prefix([1, 2, 3, 4, 9])
    assert match.blocks == blocks[:2] and match.tokens == 4 and match.partial_block is None
    assert cache.match_prefix([1, 2, 3, 4]).tokens == 3  # never the whole sequence; token by token
    assert cache.match_prefix([1, 9, 3, 4, 5]).tokens == 1
    assert cache.match_prefix([2, 9, 3, 4, 5]).tokens == 0


def test_radix_evicts_lru_unreferenced_leaves_only():
    cache = _cache()
    for seq in ([1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 9, 9]):
        blocks = cache.allocator.allocate(2)
        cache.insert(seq, blocks, cache.epoch)
        cache.allocator.decref(blocks)
    locked = cache.match_prefix([1, 2, 3, 4, 0])  # a request uses [1,2][3,4]
    cache.allocator.decref(cache.match_prefix([7, 8, 9, 9, 0]).blocks)  # touch: now the most recent
    assert cache.evict(1) == 1  # the LRU unreferenced leaf: [5,6]
    probe = cache.match_prefix([1, 2, 5, 6, 0])
    assert probe.tokens == 2
    cache.allocator.decref(probe.blocks)
    assert cache.evict(10) == 2  # [9,9] then its parent [7,8]; the locked path stays
    assert cache.num_cached_blocks == 2 and cache.evictions == 3
    cache.allocator.decref(locked.blocks)
    assert cache.evict(10) == 2 and cache.allocator.num_free_blocks == 8


def test_radix_flush_refuses_stale_epochs():
    cache = _cache()
    blocks = cache.allocator.allocate(2)
    old_epoch = cache.epoch
    cache.insert([1, 2, 3, 4], blocks, old_epoch)
    assert cache.flush() == 2 and cache.num_cached_blocks == 0
    cache.insert([1, 2, 3, 4], blocks, old_epoch)  # KV from before the flush is not cached again
    assert cache.num_cached_blocks == 0
    cache.allocator.decref(blocks)
    assert cache.allocator.num_free_blocks == 8


def test_sampling_greedy_logprobs_and_truncation():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5], [0.0, 0.1, 0.2, 5.0]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=2.0, top_k=1)]
    res = sample(logits, params, [None, None], torch.Generator().manual_seed(0), top_logprobs_num=2)
    assert res.token_ids.tolist() == [1, 3]
    expected = [F.log_softmax(logits[0], -1)[1], F.log_softmax(logits[1] / 2.0, -1)[3]]
    assert res.logprobs.tolist() == pytest.approx([float(x) for x in expected])
    assert res.top_ids.tolist()[0] == [1, 2]


@pytest.mark.parametrize("param", [{"top_p": 0.5}, {"min_p": 0.5}, {"top_k": 2}])
def test_sampling_never_picks_truncated_tokens(param):
    logits = torch.log(torch.tensor([[0.45, 0.35, 0.15, 0.05]])).repeat(400, 1)
    params = [SamplingParams(temperature=1.0, **param)] * 400
    res = sample(logits, params, [None] * 400, torch.Generator().manual_seed(0))
    allowed = {"top_p": {0, 1}, "min_p": {0, 1}, "top_k": {0, 1}}[next(iter(param))]
    assert set(res.token_ids.tolist()) == allowed


def test_seeded_rows_ignore_their_neighbours():
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=1.0)] * 3
    gens = lambda: [None, torch.Generator().manual_seed(7), None]  # noqa: E731
    a = sample(logits, params, gens(), torch.Generator().manual_seed(0)).token_ids[1]
    b = sample(logits, params, gens(), torch.Generator().manual_seed(99)).token_ids[1]
    assert a == b


def test_paged_decode_reference_matches_dense_sdpa():
    torch.manual_seed(0)
    block, hq, hkv, d = 4, 4, 2, 8
    k_pool, v_pool = torch.randn(40, hkv, d), torch.randn(40, hkv, d)
    tables = torch.tensor([[3, 1, 7, 0], [5, 2, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([14, 6], dtype=torch.int32)
    q = torch.randn(2, hq, d)
    out = attention_ref.paged_decode_attention(q, k_pool, v_pool, tables, lens, block, d**-0.5)
    for s in range(2):
        slots = attention_ref.slot_ids(tables[s], block)[: lens[s]]
        k, v = k_pool[slots].transpose(0, 1), v_pool[slots].transpose(0, 1)
        dense = F.scaled_dot_product_attention(q[s].unsqueeze(1), k, v, enable_gqa=True).squeeze(1)
        torch.testing.assert_close(out[s], dense)
        prefill = attention_ref.paged_prefill_attention(q[s : s + 1], k_pool, v_pool, slots, d**-0.5)
        torch.testing.assert_close(prefill[0], dense)
