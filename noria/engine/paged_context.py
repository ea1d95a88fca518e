"""The attention context of one engine step over the paged KV cache (the model's ``AttentionContext``).

In every layer it (1) writes the step's new K/V into the pools at their slots and (2) attends:
decode chunks together through the decode function (the C++ or Triton paged kernel, or the torch
reference), prefill chunks one sequence at a time over their gathered slots; in deterministic mode
both through ``noria.models.attention.exact_attention``. The runner builds it per step from host
metadata (:class:`DecodeMeta`, :class:`PrefillMeta`); the CUDA graphs of ``noria.engine.cuda.graphs``
build one at capture time over their static buffers. Blocking: none beyond the attention itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from noria.engine import attention_ref
from noria.engine.kv_cache import KVCache
from noria.models.attention import exact_attention

DecodeFn = Callable[..., torch.Tensor]


@dataclass
class DecodeMeta:
    """Where the decode queries of a step are and what they attend to."""

    token_idx: torch.Tensor
    """long [S]: rows of the flattened batch that are decode queries."""
    block_tables: torch.Tensor
    """int32 [S, max_blocks]."""
    context_lens: torch.Tensor
    """int32 [S]."""
    slots: torch.Tensor | None
    """Deterministic mode only: long [S, longest context], each sequence's context slots (past its
    own context, whatever its padded table points to: the exact attention masks those keys)."""
    whole: bool = False
    """``token_idx`` is every row of the step in order (no prefill chunk): the decode result is the
    layer's attention output as it is, with no gather of the queries and no scatter of the result."""


@dataclass
class PrefillMeta:
    """One prefill chunk of a step."""

    start: int
    """First row of the chunk in the flattened batch."""
    n: int
    slots: torch.Tensor
    """long [context length]: slots of the whole context, the chunk's own tokens last."""


class PagedAttentionContext:
    """The model's ``AttentionContext`` over the paged KV cache for one step."""

    def __init__(
        self,
        kv: KVCache,
        positions: torch.Tensor,
        new_slots: torch.Tensor,
        decode: DecodeMeta | None,
        prefills: list[PrefillMeta],
        decode_fn: DecodeFn,
        scale: float,
        deterministic: bool = False,
    ) -> None:
        self.kv = kv
        self._positions = positions
        self.new_slots = new_slots
        self.decode = decode
        self.prefills = prefills
        self.decode_fn = decode_fn
        self.scale = scale
        self.deterministic = deterministic

    def positions(self, batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
        return self._positions

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_pool, v_pool = self.kv.k_pools[layer_idx], self.kv.v_pools[layer_idx]
        k_pool.index_copy_(0, self.new_slots, k[0])
        v_pool.index_copy_(0, self.new_slots, v[0])
        q = q[0]
        if self.decode is not None and self.decode.whole:
            return self._attend_decode(q, k_pool, v_pool).unsqueeze(0)
        out = torch.empty_like(q)
        if self.decode is not None:
            out.index_copy_(0, self.decode.token_idx, self._attend_decode(q, k_pool, v_pool))
        for p in self.prefills:
            out[p.start : p.start + p.n] = self._attend_prefill(q[p.start : p.start + p.n], k_pool, v_pool, p.slots)
        return out.unsqueeze(0)

    def _attend_prefill(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor):
        if not self.deterministic:
            return attention_ref.paged_prefill_attention(q, k_pool, v_pool, slots, self.scale)
        n, length = q.shape[0], slots.shape[0]
        pos = torch.arange(length - n, length, device=q.device).unsqueeze(0)
        k, v = k_pool.index_select(0, slots), v_pool.index_select(0, slots)
        return exact_attention(q[None], k[None], v[None], self.scale, pos)[0]

    def _attend_decode(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        d = self.decode
        q_dec = q if d.whole else q.index_select(0, d.token_idx)
        if d.slots is not None:
            pos = (d.context_lens.long() - 1).unsqueeze(1)
            return exact_attention(q_dec[:, None], k_pool[d.slots], v_pool[d.slots], self.scale, pos)[:, 0]
        return self.decode_fn(
            q_dec, k_pool, v_pool, d.block_tables, d.context_lens, self.kv.block_size, self.scale
        )
