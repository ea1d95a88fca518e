"""The prefix cache: a radix tree over token ids at block granularity, mapping to KV block ids.

Each edge of the tree is one full block of token ids (``block_size`` tokens) and each node owns the
KV block holding them, so a path from the root spells a cached prefix. Only full blocks are
shared: a partial last block is always private to its request.

References. The tree holds one allocator reference on every block it caches. ``match_prefix`` takes
one more reference per matched block on behalf of the request (the request "locks" them) and the
request drops it when it releases its block table. A node is evictable when it is a leaf and the
tree's reference is the only one left; eviction is least-recently-used first, and freeing a leaf
can make its parent a leaf in turn.

Staleness. KV computed under old weights must not be served after a weight update, so ``flush``
drops every node and bumps ``epoch``; a request admitted under an older epoch may hold blocks
computed (partly) with old weights, and ``insert`` refuses them.

Blocking: none; used only from the engine's step thread.
Not guaranteed: a match is never the whole sequence (the last token is always recomputed so its
logits exist), and evicted prefixes are recomputed without notice.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from noria.engine.kv_cache import BlockAllocator


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    """The block's token ids (empty for the root)."""
    block: int
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_access: int = 0


@dataclass
class PrefixMatch:
    """A cached prefix locked for one request."""

    blocks: list[int]
    tokens: int


class RadixCache:
    """Block-granular prefix cache with LRU eviction; see the module docstring."""

    def __init__(self, allocator: BlockAllocator, block_size: int, enabled: bool = True) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.enabled = enabled
        self.epoch = 0
        self._root = _Node(key=(), block=-1, parent=None)
        self._clock = itertools.count(1)
        self.num_cached_blocks = 0
        self.evictions = 0
        """Blocks evicted since start."""
        self.prompt_tokens = 0
        self.hit_tokens = 0

    # ------------------------------------------------------------------------------- lookups

    def match_prefix(self, tokens: list[int], max_tokens: int | None = None) -> PrefixMatch:
        """Longest cached prefix of ``tokens`` (at most ``max_tokens``, never all of them), locked."""
        limit = (len(tokens) - 1) // self.block_size * self.block_size
        if max_tokens is not None:
            limit = min(limit, max_tokens)
        node, blocks = self._root, []
        if self.enabled:
            now = next(self._clock)
            for start in range(0, limit - self.block_size + 1, self.block_size):
                child = node.children.get(tuple(tokens[start : start + self.block_size]))
                if child is None:
                    break
                child.last_access = now
                blocks.append(child.block)
                node = child
        self.allocator.incref(blocks)
        return PrefixMatch(blocks=blocks, tokens=len(blocks) * self.block_size)

    def record_hit(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Count one admission for the hit rate (first admissions only; resumes would inflate it)."""
        self.prompt_tokens += prompt_tokens
        self.hit_tokens += cached_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    # ------------------------------------------------------------------------------- updates

    def insert(self, tokens: list[int], blocks: list[int], epoch: int) -> None:
        """Cache the full blocks of ``tokens`` (whose KV is in ``blocks``) for later requests.

        ``tokens`` must be exactly the tokens whose KV has been written. The caller still owns its
        references and releases them afterwards; a block already cached under another id keeps the
        cached copy (the caller's duplicate is freed on release).
        """
        if not self.enabled or epoch != self.epoch:
            return
        n_full = min(len(tokens) // self.block_size, len(blocks))
        node, now = self._root, next(self._clock)
        for i in range(n_full):
            key = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            child = node.children.get(key)
            if child is None:
                child = _Node(key=key, block=blocks[i], parent=node)
                node.children[key] = child
                self.allocator.incref([blocks[i]])
                self.num_cached_blocks += 1
            child.last_access = now
            node = child

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` blocks from unreferenced leaves, oldest first; returns freed."""
        heap = [(n.last_access, id(n), n) for n in self._evictable_leaves()]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_blocks:
            _, _, node = heapq.heappop(heap)
            parent = self._remove_leaf(node)
            freed += 1
            if parent is not self._root and not parent.children and self._unreferenced(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.evictions += freed
        return freed

    def flush(self) -> int:
        """Drop every node (blocks in use by requests stay theirs) and start a new epoch."""
        dropped = 0
        for node in list(self._iter_nodes()):
            self.allocator.decref([node.block])
            dropped += 1
        self._root.children.clear()
        self.num_cached_blocks = 0
        self.epoch += 1
        return dropped

    # ------------------------------------------------------------------------------- internals

    def _unreferenced(self, node: _Node) -> bool:
        return self.allocator.refcount(node.block) == 1

    def _iter_nodes(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def _evictable_leaves(self) -> list[_Node]:
        return [n for n in self._iter_nodes() if not n.children and self._unreferenced(n)]

    def _remove_leaf(self, node: _Node) -> _Node:
        parent = node.parent
        del parent.children[node.key]
        self.allocator.decref([node.block])
        self.num_cached_blocks -= 1
        return parent
