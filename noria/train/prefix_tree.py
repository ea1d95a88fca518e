"""Prefix-tree packing: a token that several sequences of a batch share goes through the model once.

A GRPO group repeats its prompt n times; samples of a group often share the start of their
response too; an agent's multi-turn episodes share their earlier turns; and every prompt of a chat
template opens with the same system message. ``share_prefixes`` builds a token trie over the
batch's sequences (consecutive or not) and packs each tree as one sequence that holds every
distinct root-to-token path once::

    sequences  a = [s y s t e m q 1 r 1]   b = [s y s t e m q 1 r 2]   c = [s y s t e m q 2 r 3]
    tree       [s y s t e m q 1 r 1 | r 2 | q 2 r 3]   parents: r2 -> q1, q2 -> m

Each node keeps its original position (its depth) and attends to its ancestors and to itself
(``TrainBatch.parents``, ``noria.models.attention.TreeLayout``), so every token is computed from
exactly the tokens it saw in its own sequence. Two tokens become one node only when everything
their forward depends on is equal: the same parent node, the same token id and, when the batch
carries MoE routes, the same route for the forward at that position (``routed_experts`` of the
next token; none recorded means the model routes by itself). Everything else a loss reads
(``loss_mask``, ``advantages``, ``rollout_logprobs``, ``weight_versions``, old and reference
logprobs) stays per original token: outputs come back with ``y[index]`` and the trainer computes
each micro-batch's loss on the original sequences it holds (``TreeParts``), so a shared trained
token's logprob is computed once, each sequence through it keeps its own loss terms, and autograd
sums their gradients. With ``trained=False`` only untrained tokens (``loss_mask`` 0 in every
sequence through them) are shared, and per-token inputs may simply move with ``x[keep]``.

Limits: a sequence joins a tree only when it shares at least ``min_prefix`` tokens with it (or all
of its tokens), and a tree holds at most ``max_tokens`` tokens (the trainer passes
``train.micro_batch_tokens``: a tree is one packed sequence and is never split across
micro-batches). A batch with images, or one already shared, comes back as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from noria.train.packing import slice_batch, take_sequences
from noria.types import TrainBatch

MIN_SHARED_PREFIX = 8
"""Fewest shared tokens for a sequence to join a tree: below it, the chain's gathered keys and
explicit mask cost more than the few tokens it saves."""

TREE_MAX_TOKENS = 4096
"""Largest tree when no budget is given (``train.micro_batch_tokens``' default)."""


@dataclass
class _Tree:
    keep: list[int] = field(default_factory=list)  # per node: the original token that created it
    parents: list[int] = field(default_factory=list)  # per node: its parent node (-1 for the root)
    children: dict[tuple[int, int], int] = field(default_factory=dict)  # (node, key) -> child node

    def walk(self, keys: list[int]) -> list[int]:
        """The nodes of the longest path from the root that matches ``keys``."""
        nodes, node = [], -1
        for key in keys:
            node = self.children.get((node, key), -2)
            if node == -2:
                break
            nodes.append(node)
        return nodes

    def grow(self, keys: list[int], start: int, below: int) -> list[int]:
        """Add ``keys`` (original tokens ``start``, ...) as a chain below node ``below``; its nodes."""
        nodes = []
        for i, key in enumerate(keys):
            node = len(self.keep)
            self.keep.append(start + i)
            self.parents.append(below)
            self.children[(below, key)] = node
            nodes.append(node)
            below = node
        return nodes


def share_prefixes(
    batch: TrainBatch, min_prefix: int = MIN_SHARED_PREFIX, max_tokens: int = TREE_MAX_TOKENS, trained: bool = False
) -> tuple[TrainBatch, torch.Tensor, torch.Tensor]:
    """Pack ``batch``'s sequences as prefix trees (see the module docstring).

    Returns ``(tree, keep, index)``: ``tree`` holds tokens ``keep`` (LongTensor [M]) of ``batch``;
    token t of ``batch`` is computed at ``tree`` position ``index[t]`` (every copy of a shared token
    maps to its one node), so outputs come back with ``y[index]``. ``trained``: trained tokens may
    be shared too; then ``tree.loss_mask`` is 1 where any sequence trains the token, its other
    per-token inputs are those of the first sequence through it, and losses must read the
    original batch (``TreeParts``). ``tree`` is ``batch`` itself when nothing is shared."""
    n = batch.n_tokens
    identity = torch.arange(n)
    if batch.parents is not None or batch.n_sequences < 2 or batch.pixel_values is not None:
        return batch, identity, identity
    cu = batch.cu_seqlens.tolist()
    starts = torch.repeat_interleave(batch.cu_seqlens[:-1].long(), torch.diff(batch.cu_seqlens).long())
    if not torch.equal(batch.positions.long(), torch.arange(n) - starts):
        return batch, identity, identity  # positions other than 0, 1, ... per sequence: not a plain packing
    keys = _token_keys(batch, trained)
    trees: list[_Tree] = []
    by_root: dict[int, list[int]] = {}
    tree_of, node_of = [0] * n, [0] * n
    for s in range(batch.n_sequences):
        seq = keys[cu[s] : cu[s + 1]]
        t, nodes = _best_tree(trees, by_root.get(seq[0], ()), seq, max_tokens)
        if t is None or len(nodes) < min(min_prefix, len(seq)):
            t, nodes = len(trees), []
            trees.append(_Tree())
            by_root.setdefault(seq[0], []).append(t)
        below = nodes[-1] if nodes else -1
        nodes = nodes + trees[t].grow(seq[len(nodes) :], cu[s] + len(nodes), below)
        tree_of[cu[s] : cu[s + 1]] = [t] * len(seq)
        node_of[cu[s] : cu[s + 1]] = nodes
    sizes = torch.tensor([len(t.keep) for t in trees], dtype=torch.long)
    if int(sizes.sum()) == n:
        return batch, identity, identity
    offsets = torch.cumsum(sizes, 0) - sizes
    index = offsets[torch.tensor(tree_of)] + torch.tensor(node_of)
    keep = torch.tensor([i for t in trees for i in t.keep], dtype=torch.long)
    parents = torch.tensor([p for t in trees for p in t.parents], dtype=torch.long)
    return _tree_batch(batch, keep, index, parents, sizes, trained), keep, index


def _best_tree(trees: list[_Tree], candidates, seq: list[int], max_tokens: int) -> tuple[int | None, list[int]]:
    """Of the trees whose root is ``seq``'s first token, the one sharing the most with ``seq`` that
    has room for the rest of it (the first such one on a tie)."""
    best, best_nodes = None, []
    for t in candidates:
        nodes = trees[t].walk(seq)
        if len(trees[t].keep) + len(seq) - len(nodes) <= max_tokens and (best is None or len(nodes) > len(best_nodes)):
            best, best_nodes = t, nodes
    return best, best_nodes


def _token_keys(batch: TrainBatch, trained: bool) -> list[int]:
    """Per token, what must be equal for two tokens under the same parent to be one node: the id,
    and the route of the forward at that position when the batch has routes; a token that may
    not be shared (trained, with ``trained`` off) gets a key of its own (negative)."""
    ids = batch.input_ids.long()
    n = ids.numel()
    if batch.routed_experts is not None:
        rows = batch.routed_experts.reshape(n, -1)
        following = torch.full_like(rows, -1)  # row t + 1: the route of the forward at t
        following[:-1] = rows[1:]
        last = batch.cu_seqlens[1:].long() - 1
        following[last] = -1  # a sequence's last forward predicts nothing: it routes by itself
        route = torch.unique(following, dim=0, return_inverse=True)[1]
        ids = ids * (int(route.max()) + 1) + route
    if not trained:
        own = -(torch.arange(n) + 1)
        ids = torch.where(batch.loss_mask > 0, own, ids)
    return ids.tolist()


def _tree_batch(batch: TrainBatch, keep, index, parents, sizes, trained: bool) -> TrainBatch:
    def take(t):
        return None if t is None else t[keep]

    loss_mask = take(batch.loss_mask)
    if trained:  # a node is trained when any sequence through it trains its token
        loss_mask = torch.zeros_like(loss_mask).scatter_reduce(0, index, batch.loss_mask, "amax")
    cu = torch.zeros(len(sizes) + 1, dtype=torch.int32)
    cu[1:] = sizes.cumsum(0)
    seq_of = torch.searchsorted(batch.cu_seqlens[1:].long(), keep, right=True)
    return TrainBatch(
        input_ids=take(batch.input_ids),
        positions=take(batch.positions),
        cu_seqlens=cu,
        loss_mask=loss_mask,
        rollout_logprobs=take(batch.rollout_logprobs),
        advantages=take(batch.advantages),
        sample_ids=batch.sample_ids[seq_of[cu[:-1].long()]],
        weight_versions=take(batch.weight_versions),
        parents=parents,
        seq_ids=seq_of,
        routed_experts=take(batch.routed_experts),
        replay_routes=batch.replay_routes,
    )


def packed_trees(cu_seqlens: torch.Tensor, parents: torch.Tensor | None) -> list[list[int] | None] | None:
    """Per packed sequence: None (a plain causal sequence) or its tokens' parents, for
    ``PackedContext(trees=)``; None when the batch has no trees."""
    if parents is None:
        return None
    cu, flat = cu_seqlens.tolist(), parents.tolist()
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        own = flat[a:b]
        out.append(None if own == list(range(-1, b - a - 1)) else own)
    return out


class TreeParts:
    """The original sequences behind each micro-batch of a tree batch, for losses computed per
    original token: ``part(a, b)`` of packed sequences [a, b) of ``tree`` gives ``(own, rows, at)``:
    the original sequences those trees hold as a batch of their own, their tokens' rows in the
    original batch, and where each is computed in the micro-batch (None: in place)."""

    def __init__(self, original: TrainBatch, tree: TrainBatch, index: torch.Tensor) -> None:
        self.original, self.tree, self.index = original, tree, index
        if tree is not original:
            firsts = index[original.cu_seqlens[:-1].long()]
            self.tree_of_seq = torch.searchsorted(tree.cu_seqlens[1:].long(), firsts, right=True)

    def part(self, a: int, b: int) -> tuple[TrainBatch, torch.Tensor | slice, torch.Tensor | None]:
        if self.tree is self.original:
            cu = self.original.cu_seqlens
            return slice_batch(self.original, a, b), slice(int(cu[a]), int(cu[b])), None
        seqs = ((self.tree_of_seq >= a) & (self.tree_of_seq < b)).nonzero().squeeze(-1)
        own, rows = take_sequences(self.original, seqs)
        return own, rows, self.index[rows] - int(self.tree.cu_seqlens[a])
