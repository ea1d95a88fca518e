"""Per-sequence reductions over packed token tensors.

A micro-batch is N tokens of S packed sequences; ``seq_index [N]`` (values 0..S-1) says which
sequence each token belongs to. The sums below use a buffer of N segments rather than S, an upper
bound (S <= N) known without reading ``seq_index`` back to the host, so nothing here synchronises
with an accelerator. Unused segments stay zero.
"""

from __future__ import annotations

import torch


def masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` [N] where ``mask`` [N] (bool) is set, else 0; NaN or inf outside the mask never leaks."""
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def segment_sum(values: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` [N] per sequence: returns [N] (entry s = sum over tokens of sequence s)."""
    out = torch.zeros(values.shape[0], dtype=values.dtype, device=values.device)
    return out.index_add(0, seq_index.long(), values)


def token_counts(mask: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
    """Masked tokens per sequence: [N] float (entry s = trained tokens of sequence s)."""
    return segment_sum(mask.float(), seq_index)


def segment_mean(values: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` [N] over each sequence's masked tokens, broadcast back to tokens: [N].

    A sequence without masked tokens gets 0.
    """
    sums = segment_sum(masked(values, mask), seq_index)
    counts = token_counts(mask, seq_index).clamp(min=1.0)
    return (sums / counts)[seq_index.long()]
