"""The trainer backend contract: what the loop asks of FSDP2 today and of Megatron later.

The loop drives a backend through six calls and never sees how the model is sharded::

    backend.init(model_path)                          # weights, optimizer, LR schedule
    old = backend.compute_logprobs(batch)             # no grad; also "reference" / "teacher"
    metrics = backend.train_step(batch, old_logprobs=old.logprobs)   # ONE optimizer step
    for bucket in backend.state_dict_for_sync(bucket_bytes): ...     # weights -> engines
    backend.save(folder, extra={...}); extra = backend.load(folder)  # DCP checkpoints
    backend.export_hf(folder)                         # safetensors transformers can load

Every rank of a distributed backend makes the same calls with the same ``TrainBatch`` (each rank
takes its own micro-batches from it); results that are per token come back whole on every rank.

The objective is a plug point: ``train_step`` computes per-token logprobs of one micro-batch and
hands them, with the micro-batch and the step-wide normalisers, to a :data:`LossFn` as
:class:`LossInputs`. The normalisers (``total_tokens``, ``total_seqs``) count the whole optimizer
step on all ranks, so the summed gradient does not depend on how the batch was split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

import torch

from noria.errors import NoriaError
from noria.train.packing import seq_index
from noria.types import TrainBatch

Which = Literal["current", "reference", "teacher"]
Metrics = dict[str, tuple[float, float]]
"""Metric name -> (sum, weight); the backend sums both over micro-batches and ranks, reports sum / weight."""


class TrainError(NoriaError):
    """The trainer cannot go on (non-finite step beyond the allowed skips, bad checkpoint, ...)."""


class NonFiniteError(TrainError):
    """A loss or gradient norm was NaN/Inf on some rank for more consecutive steps than allowed."""


class TokenLogprobs(NamedTuple):
    """Per-token results of a forward pass over a packed batch, aligned like ``TrainBatch``."""

    logprobs: torch.Tensor
    """FloatTensor [N]: log p(token t | its prefix); 0 at each sequence's first token."""
    entropy: torch.Tensor | None
    """FloatTensor [N] or None: entropy of the distribution that predicted token t."""


@dataclass(frozen=True)
class LossInputs:
    """Everything a loss sees for one micro-batch; per-token tensors are [n] for that micro-batch."""

    batch: TrainBatch
    """The micro-batch (its loss_mask, advantages, rollout_logprobs, cu_seqlens), on the compute device."""
    logprobs: torch.Tensor
    """FloatTensor [n] with grad: current-policy logprob of each token."""
    old_logprobs: torch.Tensor
    """FloatTensor [n]: logprobs of the policy before this step (the current ones, detached, if not given)."""
    ref_logprobs: torch.Tensor | None
    """FloatTensor [n] or None: reference-model logprobs (when the KL term is on)."""
    entropy: torch.Tensor | None
    """FloatTensor [n] with grad, or None unless the backend was asked for entropy."""
    seq_index: torch.Tensor
    """LongTensor [n]: each token's original sequence within the micro-batch, numbered 0, 1, ... in order
    (values below n; with shared prefixes a packed sequence holds several, see ``TrainBatch.seq_ids``)."""
    total_tokens: float
    """Loss tokens (sum of loss_mask) of the whole optimizer step, all ranks."""
    total_seqs: int
    """Sequences with at least one loss token in the whole optimizer step, all ranks."""


LossFn = Callable[[LossInputs], tuple[torch.Tensor, Metrics]]
"""Loss of one micro-batch, already divided by the step-wide normalisers, plus its metrics."""


@runtime_checkable
class TrainBackend(Protocol):
    """What the loop needs from a trainer; see the module docstring for the call order."""

    optimizer_steps: int
    """Optimizer steps applied so far (skipped non-finite steps do not count). Not the weight
    version engines serve: that is the number of completed weight syncs, owned by the RL job
    (``noria.loop.Job.weight_version``)."""

    def init(self, model_path: str | Path, total_steps: int | None = None) -> None:
        """Load the policy (and reference/teacher when configured), build optimizer and schedule."""
        ...

    def compute_logprobs(self, batch: TrainBatch, which: Which = "current", with_entropy: bool = False) -> TokenLogprobs:
        """Per-token logprobs [N] of ``batch`` under the chosen model, without gradients."""
        ...

    def train_step(
        self, batch: TrainBatch, old_logprobs: torch.Tensor | None = None, ref_logprobs: torch.Tensor | None = None
    ) -> dict[str, float]:
        """One optimizer step over the whole batch (micro-batched); returns the step's metrics."""
        ...

    def state_dict_for_sync(self, bucket_bytes: int, cast: bool = True) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full weights in the compute dtype with HF names, in buckets of about ``bucket_bytes``.
        ``cast=False`` allows a backend to give them in the dtype it keeps them (fp32 masters) for a
        sync that casts as it writes (``WeightSync.casts_on_write``), which saves a copy of the
        model; a backend may ignore it.

        Every rank must exhaust the iterator (gathering is collective); only rank 0 gets buckets.
        """
        ...

    def save(self, folder: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Write a committed checkpoint (model, optimizer, schedule, RNG, optimizer steps, extra)."""
        ...

    def load(self, folder: str | Path) -> dict[str, Any]:
        """Restore a committed checkpoint; returns its ``extra`` dict."""
        ...

    def export_hf(self, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
        """Write the policy as an HF folder (config.json + safetensors + tokenizer files)."""
        ...


def step_totals(batch: TrainBatch) -> tuple[float, int]:
    """(loss tokens, sequences with any loss token) of a whole step's batch (``batch.step_totals``
    when the batch left samples out)."""
    if batch.step_totals is not None:
        return batch.step_totals
    mask = batch.loss_mask.float()
    per_seq = torch.zeros_like(mask).index_add(0, seq_index(batch).to(mask.device), mask)
    return float(mask.sum()), int((per_seq > 0).sum())
