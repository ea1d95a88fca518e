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
"""

from __future__ import annotations

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
    """

    def __init__(self, seq_lens: Sequence[int] | torch.Tensor) -> None:
        lens = [
            int(n) for n in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)
        ]
        if not lens or any(n <= 0 for n in lens):
            raise ValueError(f"seq_lens must be positive lengths, got {lens}")
        self.seq_lens = lens
        self.total = sum(lens)

    def positions(self, batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
        self.check_shape(batch, seq_len)
        pos = torch.cat([torch.arange(n, device=device) for n in self.seq_lens])
        return pos.unsqueeze(0)

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.check_shape(q.shape[0], q.shape[1])
        outs, start = [], 0
        for n in self.seq_lens:
            end = start + n
            outs.append(_sdpa(q[:, start:end], k[:, start:end], v[:, start:end], causal=True))
            start = end
        return torch.cat(outs, dim=1)

    def check_shape(self, batch: int, seq_len: int) -> None:
        if batch != 1 or seq_len != self.total:
            raise ValueError(
                f"PackedContext expects one row of {self.total} tokens (sum of seq_lens), "
                f"got a batch of shape {(batch, seq_len)}"
            )
