"""The attention plug point of the native decoder, and the three contexts Noria ships.

The decoder owns projections, norms and RoPE; who sees whom is decided here. Every attention
layer hands its queries, keys and values (after RoPE) to an :class:`AttentionContext` and gets the
attended values back. A context is built per forward call and carries whatever the call needs:
a padding mask, packed sequence lengths, or (in the rollout engine, later) a paged KV cache with
block tables. That is why the decoder itself holds no KV-cache logic.

Shapes at the plug point (B batch rows, T tokens per row, Hq query heads, Hkv key/value heads,
D head width)::

    q [B, T, Hq, D]   k, v [B, T, Hkv, D]   ->   out [B, T, Hq, D]

A context also supplies default positions (``positions``) for when the caller passes none, since
only the context knows where each sequence starts.

Contexts here use ``torch.nn.functional.scaled_dot_product_attention`` with ``enable_gqa`` (torch
>= 2.5), so grouped-query heads are never materialised. Not guaranteed: outputs at padded query
positions are finite but meaningless; callers mask them out.

Deterministic mode (:func:`exact_attention`): SDPA's result for a query depends on how many other
queries and keys share the call (measured on CPU in bf16: a row of a causal call differs from the
same query alone over its prefix in most positions), so the engine (one decode query, prefill
chunks cut anywhere) and the trainer (whole packed sequences) could never agree bit for bit
through it. ``exact_attention`` computes every query from its own prefix with the same sequence of
fp32 operations whatever the call holds; the engine's deterministic runner and
``PackedContext(deterministic=True)`` both use it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F


@runtime_checkable
class AttentionContext(Protocol):
    """What the decoder asks of whoever decides the attention pattern."""

    def positions(self, batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
        """Default RoPE positions, LongTensor [B, T], used when the caller passes none."""
        ...

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Attention of one layer: q [B,T,Hq,D], k/v [B,T,Hkv,D] (after RoPE) -> [B,T,Hq,D]."""
        ...


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    # SDPA wants heads before tokens; the plug point keeps tokens first because that is how
    # projections come out and how a paged cache stores them.
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=causal,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def _arange_positions(batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
    return torch.arange(seq_len, device=device).unsqueeze(0).expand(batch, seq_len)


class CausalContext:
    """Each row is one sequence starting at position 0; plain causal attention."""

    def positions(self, batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
        return _arange_positions(batch, seq_len, device)

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return _sdpa(q, k, v, causal=True)


class PaddedContext:
    """Rows of different lengths padded to T (left padding for generation; right also works).

    ``attention_mask`` [B, T] is 1 for real tokens and 0 for padding. Padded keys are never
    attended to; positions count real tokens only, so a left-padded row gets the same positions
    (and logits) as the same tokens unpadded.
    """

    def __init__(self, attention_mask: torch.Tensor) -> None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"attention_mask must be [B, T], got shape {tuple(attention_mask.shape)}"
            )
        self.attention_mask = attention_mask.bool()
        self._mask: torch.Tensor | None = None  # built once, shared by all layers

    def positions(self, batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
        self.check_shape(batch, seq_len)
        valid = self.attention_mask.to(device)
        # Padding gets position 0: any value works there, and 0 keeps the RoPE table small.
        return (valid.long().cumsum(-1) - 1).clamp(min=0)

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return _sdpa(q, k, v, mask=self._dense_mask(q))

    def _dense_mask(self, q: torch.Tensor) -> torch.Tensor:
        if self._mask is None:
            batch, seq_len = q.shape[:2]
            self.check_shape(batch, seq_len)
            valid = self.attention_mask.to(q.device)
            causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
            mask = causal & valid[:, None, :]
            # A padded query of a left-padded row has no real key before it; letting it see itself
            # keeps softmax finite (an all-masked row would give NaN and poison gradients).
            mask |= torch.eye(seq_len, dtype=torch.bool, device=q.device)
            self._mask = mask.unsqueeze(1)  # [B, 1, T, T], broadcast over heads
        return self._mask

    def check_shape(self, batch: int, seq_len: int) -> None:
        if tuple(self.attention_mask.shape) != (batch, seq_len):
            raise ValueError(
                f"attention_mask has shape {tuple(self.attention_mask.shape)}, "
                f"but the batch is {(batch, seq_len)}"
            )


class PackedContext:
    """Several sequences packed back to back in one row (B = 1), each attending only to itself.

    ``seq_lens`` must sum to T. Positions restart at 0 for every sequence. Attention runs once per
    sequence rather than through one block-diagonal [T, T] mask: memory stays O(sum L^2) instead
    of O(T^2), and each sequence goes through the same causal kernel as when run alone.
    ``deterministic``: attend through :func:`exact_causal_attention` (the engine's deterministic
    arithmetic; gradients from SDPA) instead of SDPA.
    ``trees``: for each sequence, None (plain causal) or its tokens' parents (a prefix tree of
    several sequences sharing prefixes, ``noria.train.prefix_tree``): token i's parent is token
    ``trees[s][i]`` of the same packed sequence (-1 for its first token, ``0 <= parent < i`` for
    the others), and it attends to its ancestors and itself only, as if its own root-to-token path
    ran alone (:class:`TreeLayout`, :func:`tree_attention`). Its default positions are depths.
    """

    def __init__(
        self,
        seq_lens: Sequence[int] | torch.Tensor,
        deterministic: bool = False,
        trees: Sequence[Sequence[int] | None] | None = None,
    ) -> None:
        lens = [
            int(n) for n in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)
        ]
        if not lens or any(n <= 0 for n in lens):
            raise ValueError(f"seq_lens must be positive lengths, got {lens}")
        trees = list(trees) if trees is not None else [None] * len(lens)
        if len(trees) != len(lens):
            raise ValueError(f"trees has {len(trees)} entries for {len(lens)} sequences")
        for n, parents in zip(lens, trees):
            if parents is not None and len(parents) != n:
                raise ValueError(f"a tree of {len(parents)} parents for a sequence of {n} tokens")
        self.seq_lens = lens
        self.total = sum(lens)
        self.deterministic = deterministic
        self.trees = [None if p is None else TreeLayout(p) for p in trees]

    def positions(self, batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
        self.check_shape(batch, seq_len)
        pos = [
            torch.arange(n, device=device) if tree is None else torch.tensor(tree.depths, device=device)
            for n, tree in zip(self.seq_lens, self.trees)
        ]
        return torch.cat(pos).unsqueeze(0)

    def attend(  # kept out of torch.compile: keep_packing_out_of_compile
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.check_shape(q.shape[0], q.shape[1])
        attend = exact_causal_attention if self.deterministic else _causal_sdpa
        outs, start = [], 0
        for n, tree in zip(self.seq_lens, self.trees):
            end = start + n
            qs, ks, vs = q[:, start:end], k[:, start:end], v[:, start:end]
            if tree is None:
                outs.append(attend(qs, ks, vs))
            elif self.deterministic:
                outs.append(exact_tree_attention(qs, ks, vs, tree))
            else:
                outs.append(tree_attention(qs, ks, vs, tree))
            start = end
        return torch.cat(outs, dim=1)

    def check_shape(self, batch: int, seq_len: int) -> None:
        if batch != 1 or seq_len != self.total:
            raise ValueError(
                f"PackedContext expects one row of {self.total} tokens (sum of seq_lens), "
                f"got a batch of shape {(batch, seq_len)}"
            )


class TreeLayout:
    """How one packed prefix tree attends, built once per forward and shared by every layer.

    The tokens are cut into chains: maximal runs i, i+1, ... in which each token's parent is the
    one before it. A chain's queries attend to its ancestors' keys (the root-to-chain path, in
    order) and causally to its own, which are exactly the keys each query saw in its own unshared
    sequence, in the same order. No [L, L] mask is built: a chain of n tokens below a path of m
    costs an [n, m + n] attention, so the work is what the distinct root-to-token paths need."""

    def __init__(self, parents: Sequence[int]) -> None:
        parents = [int(p) for p in parents]
        if not parents or parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i):
            raise ValueError("a tree's parents must be -1 for its first token and 0 <= parent < i for token i")
        self.parents = parents
        self.depths = [0] * len(parents)
        starts = [0] + [i for i, p in enumerate(parents) if i and p != i - 1]
        ends = starts[1:] + [len(parents)]
        chain_of, self.chains = [0] * len(parents), []  # (start, end, ancestors of start)
        for c, (s, e) in enumerate(zip(starts, ends)):
            p = parents[s]
            above = [] if p < 0 else self.chains[chain_of[p]][2] + list(range(self.chains[chain_of[p]][0], p + 1))
            self.chains.append((s, e, above))
            for i in range(s, e):
                chain_of[i], self.depths[i] = c, len(above) + i - s
        self._plans: dict[torch.device, list] = {}

    def plan(self, device: torch.device) -> list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]]:
        """Per chain: (start, end, its key rows [ancestors + own] or None for a root chain, its
        bool [n, m + n] mask: query i sees the m ancestors and its own keys up to itself)."""
        if device not in self._plans:
            out = []
            for s, e, above in self.chains:
                if not above:
                    out.append((s, e, None, None))
                    continue
                rows = torch.tensor(above + list(range(s, e)), dtype=torch.long, device=device)
                n, m = e - s, len(above)
                mask = torch.ones(n, m + n, dtype=torch.bool, device=device).tril(m)
                out.append((s, e, rows, mask))
            self._plans[device] = out
        return self._plans[device]


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree: TreeLayout) -> torch.Tensor:
    """SDPA over a prefix tree (:class:`TreeLayout`): q [B, L, Hq, D], k/v [B, L, Hkv, D] ->
    [B, L, Hq, D], each chain against its ancestors and itself; differentiable (a key shared by
    several chains gets the sum of their gradients)."""
    outs = []
    for s, e, rows, mask in tree.plan(q.device):
        if rows is None:
            outs.append(_sdpa(q[:, s:e], k[:, s:e], v[:, s:e], causal=True))
        else:
            outs.append(_sdpa(q[:, s:e], k.index_select(1, rows), v.index_select(1, rows), mask=mask))
    return torch.cat(outs, dim=1)


def keep_packing_out_of_compile() -> None:
    """Keep ``PackedContext.attend`` out of ``torch.compile``: it loops over the packed sequences, so a
    traced one would recompile for every new packing. Called by whatever compiles layers
    (``noria.train.fsdp.compile_layer``), not at import: ``torch.compiler.disable`` imports
    ``torch._dynamo``, which took a second of every Noria process's start (engines, ranks, the CLI)."""
    if not getattr(PackedContext.attend, "_noria_not_compiled", False):
        attend = torch.compiler.disable(PackedContext.attend)
        attend._noria_not_compiled = True
        PackedContext.attend = attend


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _sdpa(q, k, v, causal=True)


# --------------------------------------------------------------------------- deterministic mode

EXACT_KEY_BLOCK = 64
"""Keys per block in :func:`exact_attention`: every matmul there has a fixed inner size (head_dim
for scores, this for values), which is what keeps its summation order fixed."""

EXACT_ROW_TILE = 16
"""Query rows per matmul in :func:`exact_attention` (rows are query x query head of a KV group;
fewer are zero-padded): one fixed shape per matmul is what keeps a row's bits independent of the
call. 16 covers a decode step of the common GQA groups (2-8 query heads per KV head) in one tile."""

EXACT_QUERY_BLOCK = 128
"""Queries per call in :func:`exact_causal_attention` (bounds memory; does not change results)."""


def attention_scale(head_dim: int) -> float:
    """The softmax scale, 1 / sqrt(head_dim); one expression for engine and trainer."""
    return 1.0 / math.sqrt(head_dim)


def exact_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_pos: torch.Tensor
) -> torch.Tensor:
    """Batch-invariant attention: q [B, n, Hq, D], k/v [B, L, Hkv, D] -> [B, n, Hq, D] in q's dtype.

    Query i of row b sees keys 0 .. ``q_pos[b, i]`` (long [B, n]; its minimum is read on the host).
    Its output depends only on its own query and those keys, bit for bit: not on B, n, L, the other
    queries, or keys past its own (which may hold anything, NaN included). How, in fp32:

    - every matmul has one fixed shape: keys go in blocks of :data:`EXACT_KEY_BLOCK` (the last one
      zero-padded) and query rows in tiles of :data:`EXACT_ROW_TILE` (the last one zero-padded), so
      scores ``q_tile @ k_block^T`` are always [tile, head_dim] x [head_dim, block] and weighted
      values ``p_tile @ v_block`` always [tile, block] x [block, head_dim], and each block's softmax
      denominator is a sum over the block's fixed width;
    - ``p = exp(s - max)`` with the max over visible keys (exact), then 0 at hidden keys;
    - block results are added one after the other in key order: a block past a query's last key
      adds exact zeros, so L changes nothing.

    Measured, not promised by MKL (torch 2.13; ``tests/engine/test_exact_agreement.py``): an fp32 matmul
    of one fixed shape gives a row the same bits wherever it sits in the tile, whatever the other
    rows hold and however many matrices share the batched call — on AVX-512 and on AVX2 (where
    MKL's result for a row does change with the number of rows, which is why the tiles are fixed).
    """
    if q.is_cuda:
        from noria.models import exact_cuda

        if exact_cuda.available():  # the same contract, by a fixed-order Triton kernel (other bits)
            return exact_cuda.attention(q, k, v, scale, q_pos)
    batch, n, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    rows = n * group
    tiles = -(-rows // EXACT_ROW_TILE)
    padded = tiles * EXACT_ROW_TILE
    nb = -(-k.shape[1] // EXACT_KEY_BLOCK)
    # Rows of each kv head are (query, query head of its group), so GQA heads share one matmul.
    qf = q.new_zeros(batch, hkv, padded, d, dtype=torch.float32)
    qf[:, :, :rows] = q.float().reshape(batch, n, hkv, group, d).permute(0, 2, 1, 3, 4).reshape(batch, hkv, rows, d)
    row_pos = q_pos.new_zeros(batch, padded)  # padding rows see key 0 only, and are dropped
    row_pos[:, :rows] = q_pos.repeat_interleave(group, dim=1)
    qf = qf.view(batch, hkv, 1, tiles, EXACT_ROW_TILE, d)
    keys_t = _key_blocks(k, nb).transpose(-1, -2).contiguous().unsqueeze(3)  # [B, Hkv, nb, 1, D, block]
    scores = torch.matmul(qf, keys_t).mul_(scale).view(batch, hkv, nb, padded, EXACT_KEY_BLOCK)
    # Blocks before `first` are visible to every row; only the others need masking.
    first = (int(q_pos.min()) + 1) // EXACT_KEY_BLOCK
    keys = torch.arange(first * EXACT_KEY_BLOCK, nb * EXACT_KEY_BLOCK, device=q.device).view(-1, 1, EXACT_KEY_BLOCK)
    hidden = keys > row_pos.view(batch, 1, 1, -1, 1)  # [B, 1, nb - first, padded, block]
    tail = scores[:, :, first:]
    block_top = torch.cat([scores[:, :, :first].amax(-1), tail.masked_fill(hidden, float("-inf")).amax(-1)], 2)
    top = block_top.amax(2, keepdim=True).unsqueeze(-1)
    # exp of the raw scores, then zeros where hidden: exp(-inf) is slow here, and hidden keys may
    # be garbage (masked_fill also turns their inf/NaN into 0).
    probs = scores.sub_(top).exp_()
    tail.masked_fill_(hidden, 0.0)  # a view of probs now
    values = _key_blocks(v, nb)
    # Keys past every query of a row may be garbage (padded cache slots): 0 * NaN would be NaN.
    unused = torch.arange(nb * EXACT_KEY_BLOCK, device=q.device) > q_pos.amax(1, keepdim=True)
    values.masked_fill_(unused.view(batch, 1, nb, EXACT_KEY_BLOCK, 1), 0.0)
    tiled = probs.view(batch, hkv, nb, tiles, EXACT_ROW_TILE, EXACT_KEY_BLOCK)
    weighted = torch.matmul(tiled, values.unsqueeze(3)).view(batch, hkv, nb, padded, d)
    denom = probs.sum(-1, keepdim=True)  # over the block's fixed width
    num, den = weighted[:, :, 0], denom[:, :, 0]
    for j in range(1, nb):  # in key order, one block at a time
        num, den = num + weighted[:, :, j], den + denom[:, :, j]
    out = (num / den)[:, :, :rows]
    return out.reshape(batch, hkv, n, group, d).permute(0, 2, 1, 3, 4).reshape(batch, n, hq, d).to(q.dtype)


def _key_blocks(x: torch.Tensor, nb: int) -> torch.Tensor:
    """x [B, L, Hkv, D] -> fp32 [B, Hkv, nb, block, D], zero-padded past L, contiguous."""
    batch, length, hkv, d = x.shape
    out = x.new_zeros(batch, hkv, nb * EXACT_KEY_BLOCK, d, dtype=torch.float32)
    out[:, :, :length] = x.transpose(1, 2)
    return out.view(batch, hkv, nb, EXACT_KEY_BLOCK, d)


def exact_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of whole sequences through :func:`exact_attention`: q [B, T, Hq, D], k/v
    [B, T, Hkv, D] -> [B, T, Hq, D]. Differentiable: the backward is SDPA's (recomputed), i.e.
    the gradient of the same function up to rounding."""
    return _ExactCausal.apply(q, k, v)


def _exact_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, out: torch.Tensor) -> None:
    """``out[:] =`` exact attention of queries at positions offset, offset + 1, ... over keys ``k``
    (query i sees keys 0 .. offset + i), in blocks of :data:`EXACT_QUERY_BLOCK` queries."""
    batch, n = q.shape[:2]
    scale = attention_scale(q.shape[-1])
    for lo in range(0, n, EXACT_QUERY_BLOCK):
        hi = min(lo + EXACT_QUERY_BLOCK, n)
        pos = torch.arange(offset + lo, offset + hi, device=q.device).expand(batch, hi - lo)
        out[:, lo:hi] = exact_attention(q[:, lo:hi], k[:, : offset + hi], v[:, : offset + hi], scale, pos)


class _ExactCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(q, k, v)
        out = torch.empty_like(q)
        _exact_rows(q, k, v, 0, out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = _sdpa(q, k, v, causal=True)
        return torch.autograd.grad(out, (q, k, v), grad)


def exact_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree: TreeLayout) -> torch.Tensor:
    """:func:`exact_causal_attention` of a prefix tree (:class:`TreeLayout`): each chain's queries go
    through :func:`exact_attention` over [its ancestors' keys, its own keys], the very keys it would
    see in its own sequence packed alone, so every output row has the bits of the unshared run.
    The backward is :func:`tree_attention`'s (SDPA, recomputed)."""
    return _ExactTree.apply(q, k, v, tree)


class _ExactTree(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tree: TreeLayout):
        ctx.save_for_backward(q, k, v)
        ctx.tree = tree
        out = torch.empty_like(q)
        for s, e, rows, _mask in tree.plan(q.device):
            if rows is None:
                _exact_rows(q[:, s:e], k[:, s:e], v[:, s:e], 0, out[:, s:e])
            else:
                offset = rows.numel() - (e - s)
                _exact_rows(q[:, s:e], k.index_select(1, rows), v.index_select(1, rows), offset, out[:, s:e])
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = tree_attention(q, k, v, ctx.tree)
        return (*torch.autograd.grad(out, (q, k, v), grad), None)
