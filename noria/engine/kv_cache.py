"""The paged KV cache: per-layer K and V pools, and the block allocator that hands out their pages.

Layout. Each layer owns a K pool and a V pool, tensors ``[num_slots, Hkv, D]`` in the model dtype on
the engine's device, with ``num_slots = num_blocks * block_size``. A token's K/V live at one slot,
``slot = block_id * block_size + offset``; a sequence's tokens are found through its block table
(the list of its block ids, in order). Blocks are the unit of allocation and of sharing; a prefix
match that ends inside a block copies that block's matched slots into a fresh one (``copy_prefix``).

Ownership. :class:`BlockAllocator` counts references per block: every holder (a running request's
block table, a node of the prefix cache) holds one reference, and a block returns to the free list
when its count drops to zero. Nothing here knows which holder is which; the scheduler and the radix
cache keep that straight.

Blocking: none. The allocator is plain Python, used only from the engine's step thread.
Not guaranteed: a slot past a sequence's context length holds zeros or another request's old
K/V (always finite); readers must mask by context length.
"""

from __future__ import annotations

import math
import mmap

import torch

from noria.config import EngineConfig
from noria.models.config import ModelArgs


class OutOfBlocks(RuntimeError):
    """The allocator has fewer free blocks than asked for (callers evict or retract, then retry)."""


class BlockAllocator:
    """Reference-counted block ids with a free list."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.reset()

    def reset(self) -> None:
        """Every block free, low ids handed out first, none counted as written (the pools were mapped
        again). Popped from the end: recently freed blocks are reused first (warm in cache), so fresh
        ids go out in order and every id from :attr:`_fresh` on was never handed out."""
        self._refs = [0] * self.num_blocks
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._fresh = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_written_free_blocks(self) -> int:
        """Free blocks handed out before (written: reusing them costs no new memory)."""
        return len(self._free) - (self.num_blocks - self._fresh)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks, each with one reference; raises :class:`OutOfBlocks` (taking none)."""
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        self._fresh = max(self._fresh, max(blocks, default=-1) + 1)
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"incref of free block {b}")
            self._refs[b] += 1

    def decref(self, blocks: list[int]) -> None:
        """Drop one reference per block; blocks reaching zero go back to the free list."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"decref of free block {b} (double free)")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def refcount(self, block: int) -> int:
        return self._refs[block]


class KVCache:
    """K/V pools for every layer plus their allocator."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)
        self.lazy = torch.device(device).type == "cpu"
        """The pools are mapped lazily (``zeroed_pools``): a block costs memory once written."""
        # On CUDA one slot past every block is scratch: padded rows of a captured decode graph
        # (noria.engine.cuda.graphs) write their K/V there. The CPU layout is unchanged.
        scratch = 1 if torch.device(device).type == "cuda" else 0
        self.scratch_slot: int | None = num_blocks * block_size if scratch else None
        shape = (num_blocks * block_size + scratch, num_kv_heads, head_dim)
        self.k_pools, self.v_pools = zeroed_pools(num_layers, shape, dtype, device)

    @classmethod
    def for_model(
        cls, args: ModelArgs, config: EngineConfig, dtype: torch.dtype, device: torch.device
    ) -> KVCache:
        """Size the cache from ``config``: explicit tokens, or a share of free memory bounded by what
        the job can use (``engine.kv_job_tokens``; see ``noria.config.engine.job_kv_tokens``)."""
        tokens = config.kv_cache_tokens
        if tokens is None:
            budget = config.kv_memory_fraction * available_memory_bytes(device)
            tokens = int(budget // bytes_per_token(args, dtype))
            if config.kv_job_tokens is not None:
                tokens = min(tokens, config.kv_job_tokens)
        num_blocks = tokens // config.block_size
        if num_blocks < 1:
            raise ValueError(
                f"KV cache too small: {tokens} tokens for block_size {config.block_size} "
                f"(raise engine.kv_cache_tokens or engine.kv_memory_fraction)"
            )
        return cls(args.num_layers, num_blocks, config.block_size, args.num_kv_heads, args.head_dim, dtype, device)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy the K/V of the first ``n`` slots of block ``src`` into block ``dst``, every layer
        (copy-on-write of a prefix match that ends inside a block, ``noria.engine.radix``). Queued
        on the device in stream order, so a step launched after it reads the copy."""
        a, b = src * self.block_size, dst * self.block_size
        for pool in (*self.k_pools, *self.v_pools):
            pool[b : b + n].copy_(pool[a : a + n])

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Share of blocks in use (by requests or by the prefix cache)."""
        return self.allocator.num_used_blocks / self.num_blocks


def zeroed_pools(
    num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """K and V pools of ``shape`` for every layer, zero-filled.

    Zeroed, not empty: padded readers mask slots out with a zero weight, and 0 * NaN garbage from
    uninitialised memory would still be NaN. On the CPU every pool is a view of one private
    anonymous ``mmap`` (fresh zero pages that the kernel maps on first touch) rather than
    ``torch.zeros`` (a memset of every byte): a cache of several GB then costs no start-up time
    (``torch.zeros`` took 2 s per 5 GB on a 2-core AMD EPYC Zen 4) and no resident memory until its
    blocks are written. The allocator hands out low block ids first and reuses freed ones, so what
    is touched follows what is used; the prefix cache gives back its own written blocks before a fresh
    one is written once it holds ``engine.prefix_cache_share`` of them (``noria.engine.scheduler``).
    One mapping of its own, not the C heap: ``numpy.zeros`` (calloc)
    of a pool under glibc's mmap threshold (up to 32 MiB a pool, raised by earlier large frees) came
    from the heap and was memset, so the whole cache was resident after each
    ``release_memory_occupation`` / resume (0.75 GB for the main job's 32768 tokens), and freeing it
    left the pages in the heap; the mapping is returned to the kernel when the last view goes.
    """
    if torch.device(device).type != "cpu":
        pools = [[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)] for _ in "kv"]
        return pools[0], pools[1]
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_pool = math.prod(shape)
    arena = lazy_zeros(2 * num_layers * per_pool * itemsize).view(dtype).view(2, num_layers, *shape)
    return [arena[0, i] for i in range(num_layers)], [arena[1, i] for i in range(num_layers)]


def lazy_zeros(nbytes: int) -> torch.Tensor:
    """``nbytes`` zero bytes (uint8) in a private anonymous mapping: no page is resident until it is
    written, and the mapping is unmapped when the last tensor viewing it is freed."""
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]  # the tensor keeps the mapping alive


def bytes_per_token(args: ModelArgs, dtype: torch.dtype) -> int:
    """K and V of one token over all layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * args.num_layers * args.num_kv_heads * args.head_dim * itemsize


def available_memory_bytes(device: torch.device | str) -> int:
    """Free memory where the cache will live: CUDA's free bytes, else /proc/meminfo MemAvailable."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError("/proc/meminfo has no MemAvailable; set engine.kv_cache_tokens explicitly")
