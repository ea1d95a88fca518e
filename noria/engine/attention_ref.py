"""Torch reference attention over the paged KV cache: decode (one query) and prefill chunks.

``paged_decode_attention`` has exactly the signature of ``noria.engine.kernels.paged_decode_attention``
so the runner can use either. It gathers every sequence's slots into a padded
``[S, W, Hkv, D]`` tensor (W = the block table width times the block size), masks slots past each
context length, and runs one SDPA: no host sync (the width comes from the block table's shape).

``paged_decode_attention_per_seq`` and ``paged_prefill_attention`` attend one sequence at a time
over exactly its context: their result for a sequence does not depend on the rest of the batch,
which is what deterministic mode needs.

Blocking: none. Not guaranteed: the padded batched path and the per-sequence path agree to rounding,
not bitwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def slot_ids(block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots of every position covered by ``block_table`` (int [..., B]) -> long [..., B*block_size]."""
    offsets = torch.arange(block_size, device=block_table.device)
    slots = block_table.long().unsqueeze(-1) * block_size + offsets
    return slots.flatten(-2)


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """q [S, Hq, D] over each sequence's first ``context_lens[s]`` cached tokens -> [S, Hq, D]."""
    slots = slot_ids(block_tables, block_size)  # [S, W]
    k = k_pool[slots].transpose(1, 2)  # [S, Hkv, W, D]
    v = v_pool[slots].transpose(1, 2)
    width = slots.shape[1]
    valid = torch.arange(width, device=q.device).unsqueeze(0) < context_lens.unsqueeze(1).long()
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        k,
        v,
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(2)


def paged_decode_attention_per_seq(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: list[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Batch-invariant decode: q [S, Hq, D], ``slots[s]`` long [L_s] -> [S, Hq, D]."""
    outs = [
        paged_prefill_attention(q[s : s + 1], k_pool, v_pool, slots[s], scale) for s in range(len(slots))
    ]
    return torch.cat(outs, dim=0)


def paged_prefill_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, Hq, D] = the last n of a sequence's L tokens whose K/V sit at ``slots`` [L] -> [n, Hq, D].

    Causal, aligned bottom-right: query i (position L - n + i) sees keys 0 .. L - n + i.
    """
    n, length = q.shape[0], slots.shape[0]
    k = k_pool.index_select(0, slots).transpose(0, 1)  # [Hkv, L, D]
    v = v_pool.index_select(0, slots).transpose(0, 1)
    if q.is_cuda and n > 1:
        return _prefill_sdpa_4d(q, k, v, scale)
    mask = None
    if 1 < n < length:
        rows = torch.arange(n, device=q.device).unsqueeze(1) + (length - n)
        mask = torch.arange(length, device=q.device).unsqueeze(0) <= rows
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k,
        v,
        attn_mask=mask,
        is_causal=n == length and n > 1,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[0],
    )
    return out.transpose(0, 1)


def _prefill_sdpa_4d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """CUDA: the same attention with a batch dimension and the causal mask as a
    ``causal_lower_right`` bias, so that SDPA can run the flash (or memory-efficient) kernel; 3-D
    inputs and a boolean mask send it to the math kernel (fp32 score matrices per sequence)."""
    from torch.nn.attention.bias import causal_lower_right

    n, length = q.shape[0], k.shape[1]
    q4, k4, v4 = q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if n == length:
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=q4.shape[1] != k4.shape[1])
    else:  # after a cached prefix; the lower-right bias has no GQA argument: heads repeated
        groups = q4.shape[1] // k4.shape[1]
        if groups > 1:
            k4, v4 = k4.repeat_interleave(groups, dim=1), v4.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=causal_lower_right(n, length), scale=scale)
    return out[0].transpose(0, 1)
