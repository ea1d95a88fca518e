"""The prefix cache: a radix tree over token ids, mapping to KV block ids, matched token by token.

Tree. Each edge below the root holds the token ids of one KV block and the node owns that block,
so a path from the root spells a cached prefix. An inner node's key is a full block
(``block_size`` tokens); a leaf's key may be shorter: a *partial* node, the tail of a sequence
whose last block was not full (the last turn of a conversation, generated tokens included).

Matching is at token granularity. ``match_prefix`` walks full blocks by exact key, then looks at
the children of the last node it reached for the longest common prefix with the request's next
tokens: a partial node, or the first tokens of a full block. A match may so end inside a block:
the request gets the full blocks, plus the source block and how many of its tokens match
(``PrefixMatch.partial_block`` / ``partial_tokens``). The scheduler copies those tokens' K/V into a
fresh block of the request's own (copy-on-write; ``KVCache.copy_prefix``) and releases the source:
a cached block is never written again, so every reader of it keeps its bits. (Measured against
sharing the source block with a per-request fill length, which saves the copy: no difference in
TTFT or tokens/s beyond noise, see docs/engines.md; the copy keeps every kernel's block-table
layout as it is.)

Inserting keeps one leaf per branch: a partial node whose key is a prefix of a newer insert's
(the previous turn's tail, extended by this turn) is dropped, and a tail already covered by a
longer key is not added.

References. The tree holds one allocator reference on every block it caches. ``match_prefix`` takes
one more reference per matched block on behalf of the request (the request "locks" them) and the
request drops it when it releases its block table; the partial source's reference is dropped
right after the copy. A node is evictable when it is a leaf and the tree's reference is the only
one left; eviction is least-recently-used first, and freeing a leaf can make its parent a leaf in
turn. So eviction never frees a block a running request reads.

Namespaces. Each namespace has a tree of its own (``match_prefix`` / ``insert`` take one; None is
the base model's): the engine keys a LoRA adapter's requests by the adapter's key, new at every
load and update, so KV computed with one adapter (or one version of it) is never served to another
request's tokens (the same reason image placeholders are keyed by content, ``vision.cache_ids``).

Staleness. KV computed under old weights must not be served after a weight update, so ``flush``
drops every node and bumps ``epoch``; a request admitted under an older epoch may hold blocks
computed (partly) with old weights, and ``insert`` refuses them.

``token_match = False`` restores whole-block matching (no partial matches, no partial nodes): the
behaviour before token granularity, kept as the baseline of ``noria bench prefix``.

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
    """The block's token ids (empty for the root; shorter than a block for a partial leaf)."""
    block: int
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    by_first: dict[int, list[_Node]] = field(default_factory=dict)
    """The children again, by their first token (the candidates of a partial match)."""
    last_access: int = 0

    def add(self, child: _Node) -> None:
        self.children[child.key] = child
        self.by_first.setdefault(child.key[0], []).append(child)

    def remove(self, child: _Node) -> None:
        del self.children[child.key]
        siblings = self.by_first[child.key[0]]
        siblings.remove(child)
        if not siblings:
            del self.by_first[child.key[0]]


@dataclass
class PrefixMatch:
    """A cached prefix locked for one request."""

    blocks: list[int]
    """Full blocks, in order, one reference each taken for the request."""
    tokens: int
    """Matched tokens: the full blocks' and ``partial_tokens``."""
    partial_block: int | None = None
    """The block holding the match's last ``partial_tokens`` tokens (one reference taken; the
    request copies them into a block of its own and drops it), or None."""
    partial_tokens: int = 0
    partial_fill: int = 0
    """Tokens the cache holds in ``partial_block`` (>= ``partial_tokens``)."""


def common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class RadixCache:
    """Token-granular prefix cache over KV blocks with LRU eviction; see the module docstring."""

    def __init__(self, allocator: BlockAllocator, block_size: int, enabled: bool = True) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.enabled = enabled
        self.token_match = True
        self.epoch = 0
        self._root = _Node(key=(), block=-1, parent=None)
        self._roots: dict[object, _Node] = {None: self._root}
        """The root of each namespace's tree (None: the base model's)."""
        self._clock = itertools.count(1)
        self.num_cached_blocks = 0
        self.evictions = 0
        """Blocks evicted since start."""
        self.prompt_tokens = 0
        """Prompt tokens of every first admission since start."""
        self.hit_tokens = 0
        """Of those, tokens served from the cache."""

    # ------------------------------------------------------------------------------- lookups

    def match_prefix(self, tokens: list[int], max_tokens: int | None = None, namespace: object = None) -> PrefixMatch:
        """Longest cached prefix of ``tokens`` (at most ``max_tokens``, never all of them) in
        ``namespace``'s tree, locked."""
        limit = len(tokens) - 1
        if max_tokens is not None:
            limit = min(limit, max_tokens)
        if not self.enabled or limit <= 0:
            return PrefixMatch(blocks=[], tokens=0)
        node, blocks, pos, bs = self._roots.get(namespace), [], 0, self.block_size
        if node is None:
            return PrefixMatch(blocks=[], tokens=0)
        now = next(self._clock)
        while pos + bs <= limit:
            child = node.children.get(tuple(tokens[pos : pos + bs]))
            if child is None:
                break
            child.last_access = now
            blocks.append(child.block)
            node, pos = child, pos + bs
        self.allocator.incref(blocks)
        match = PrefixMatch(blocks=blocks, tokens=pos)
        if self.token_match and pos < limit:
            best, best_n = None, 0
            want = tokens[pos : min(limit, pos + bs)]
            for child in node.by_first.get(tokens[pos], ()):
                n = common_prefix(child.key, want)
                if n > best_n:
                    best, best_n = child, n
            if best is not None and best_n < bs:  # a whole block would have matched above
                best.last_access = now
                self.allocator.incref([best.block])
                match.partial_block, match.partial_tokens, match.partial_fill = best.block, best_n, len(best.key)
                match.tokens += best_n
        return match

    def unlock(self, match: PrefixMatch) -> None:
        """Drop the references ``match_prefix`` took (a request that was not admitted after all)."""
        self.allocator.decref(match.blocks)
        if match.partial_block is not None:
            self.allocator.decref([match.partial_block])

    def record_hit(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Count one admission for the hit rate (first admissions only; resumes would inflate it)."""
        self.prompt_tokens += prompt_tokens
        self.hit_tokens += cached_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    # ------------------------------------------------------------------------------- updates

    def insert(self, tokens: list[int], blocks: list[int], epoch: int, namespace: object = None) -> None:
        """Cache ``tokens`` (whose KV is in ``blocks``, in order) for later requests: every full
        block, and the partial last one (with ``token_match``).

        ``tokens`` must be exactly the tokens whose KV has been written. The caller still owns its
        references and releases them afterwards; a block already cached under another id keeps the
        cached copy (the caller's duplicate is freed on release).
        """
        if not self.enabled or epoch != self.epoch:
            return
        bs = self.block_size
        n_full = min(len(tokens) // bs, len(blocks))
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = _Node(key=(), block=-1, parent=None)
        now = next(self._clock)
        for i in range(n_full):
            node = self._child(node, tuple(tokens[i * bs : (i + 1) * bs]), blocks[i], now)
        tail = tuple(tokens[n_full * bs : (n_full + 1) * bs])
        if self.token_match and tail and len(tail) < bs and n_full < len(blocks):
            self._child(node, tail, blocks[n_full], now)

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` blocks from unreferenced leaves, oldest first; returns freed."""
        heap = [(n.last_access, id(n), n) for n in self._evictable_leaves()]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_blocks:
            _, _, node = heapq.heappop(heap)
            parent = self._remove_leaf(node)
            freed += 1
            if parent.parent is not None and not parent.children and self._unreferenced(parent):
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
        self._root.by_first.clear()
        self._roots = {None: self._root}
        self.num_cached_blocks = 0
        self.epoch += 1
        return dropped

    # ------------------------------------------------------------------------------- internals

    def _child(self, node: _Node, key: tuple[int, ...], block: int, now: int) -> _Node:
        """The child of ``node`` holding ``key``, added with ``block`` if no child covers it."""
        child = node.children.get(key)
        if child is None and len(key) < self.block_size:
            child = next((c for c in node.by_first.get(key[0], ()) if c.key[: len(key)] == key), None)
        if child is None:
            for old in [c for c in node.by_first.get(key[0], ()) if len(c.key) < len(key) and key[: len(c.key)] == c.key]:
                self._remove_leaf(old)  # a shorter tail this key extends: the new node serves its matches
            child = _Node(key=key, block=block, parent=node)
            node.add(child)
            self.allocator.incref([block])
            self.num_cached_blocks += 1
        child.last_access = now
        return child

    def _unreferenced(self, node: _Node) -> bool:
        return self.allocator.refcount(node.block) == 1

    def _iter_nodes(self):
        stack = [n for root in self._roots.values() for n in root.children.values()]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def _evictable_leaves(self) -> list[_Node]:
        return [n for n in self._iter_nodes() if not n.children and self._unreferenced(n)]

    def _remove_leaf(self, node: _Node) -> _Node:
        parent = node.parent
        parent.remove(node)
        self.allocator.decref([node.block])
        self.num_cached_blocks -= 1
        if parent.parent is None and parent is not self._root and not parent.children:
            self._roots = {ns: r for ns, r in self._roots.items() if r is not parent}  # an emptied namespace
        return parent
