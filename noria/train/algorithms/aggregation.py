"""Aggregations: per-token values of one micro-batch -> its share of the step's scalar loss.

The key property: every normaliser comes from ``LossNorm``, counted once over the WHOLE optimizer
step (all micro-batches, all data-parallel ranks), never from the micro-batch at hand. Each
micro-batch's aggregate is then its exact share of the step loss, and the gradients summed over
micro-batches are the same however the step was split.

What this needs from the caller:
- a sequence is never split across micro-batches (per-sequence means need all of its tokens);
- gradients are SUMMED over micro-batches and ranks. FSDP2 and DDP average over ranks by default:
  the backend must undo that (multiply the loss by the world size, or set the divide factor to 1),
  since ``LossNorm`` already divides by the global totals.

Contract: ``fn(cfg, values [N], loss_mask [N] bool, seq_index [N], norm) -> scalar``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from noria.config import LossConfig
from noria.train.algorithms.registry import lookup, register
from noria.train.algorithms.segments import masked, segment_sum, token_counts


@dataclass(frozen=True, slots=True)
class LossNorm:
    """Loss normalisers of one whole optimizer step, over every micro-batch and data-parallel rank."""

    total_tokens: float
    """Trained tokens (loss_mask > 0) in the step."""
    total_seqs: float
    """Sequences with at least one trained token in the step."""

    @classmethod
    def from_masks(cls, loss_masks: Sequence[torch.Tensor], seq_indices: Sequence[torch.Tensor]) -> LossNorm:
        """Count over the micro-batches of one rank: ``loss_masks[k]`` and ``seq_indices[k]`` are [N_k].

        With several ranks, all-reduce (sum) ``total_tokens`` and ``total_seqs`` across them before use.
        """
        tokens, seqs = 0.0, 0.0
        for mask, seq_index in zip(loss_masks, seq_indices, strict=True):
            keep = mask > 0
            tokens += float(keep.sum())
            seqs += float((token_counts(keep, seq_index) > 0).sum())
        return cls(total_tokens=tokens, total_seqs=seqs)


AggregationFn = Callable[[LossConfig, torch.Tensor, torch.Tensor, torch.Tensor, LossNorm], torch.Tensor]
AGGREGATIONS: dict[str, AggregationFn] = {}
"""Loss aggregations by name (``train.loss.aggregation``)."""


def register_aggregation(name: str) -> Callable[[AggregationFn], AggregationFn]:
    """Decorator registering an aggregation with the contract of this module."""
    return register(AGGREGATIONS, "aggregation", name)


def get_aggregation(name: str) -> AggregationFn:
    """The aggregation registered as ``name``."""
    return lookup(AGGREGATIONS, "aggregation", name, "train.loss.aggregation")


def _safe(total: float) -> float:
    """A step without trained tokens has a zero loss, not a division by zero."""
    return max(float(total), 1.0)


@register_aggregation("token_mean")
def token_mean(cfg: LossConfig, values: torch.Tensor, loss_mask: torch.Tensor, seq_index: torch.Tensor, norm: LossNorm) -> torch.Tensor:
    """sum over trained tokens of l_t / total trained tokens of the step; every token weighs the same.

    Reference: Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (2025),
    token-level policy gradient loss.
    """
    return masked(values, loss_mask).sum() / _safe(norm.total_tokens)


@register_aggregation("seq_mean_token_mean")
def seq_mean_token_mean(
    cfg: LossConfig, values: torch.Tensor, loss_mask: torch.Tensor, seq_index: torch.Tensor, norm: LossNorm
) -> torch.Tensor:
    """sum over sequences i of (mean of l_t over the trained tokens of i) / total sequences of the step.

    Every sequence weighs the same whatever its length: GRPO's original 1/|o_i| form.
    Reference: Shao et al., "DeepSeekMath" (2024).
    """
    sums = segment_sum(masked(values, loss_mask), seq_index)
    counts = token_counts(loss_mask, seq_index).clamp(min=1.0)
    return (sums / counts).sum() / _safe(norm.total_seqs)


@register_aggregation("seq_mean_token_sum")
def seq_mean_token_sum(
    cfg: LossConfig, values: torch.Tensor, loss_mask: torch.Tensor, seq_index: torch.Tensor, norm: LossNorm
) -> torch.Tensor:
    """sum over trained tokens of l_t / (total sequences of the step * C), C = ``cfg.seq_sum_divisor`` or 1.

    No per-sequence length normalisation. With C set to a constant such as the maximum response
    length this is Dr.GRPO's aggregation: mean over sequences of (token sum / C).
    Reference: Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective" (2025).
    """
    divisor = cfg.seq_sum_divisor or 1.0
    return masked(values, loss_mask).sum() / (_safe(norm.total_seqs) * divisor)
