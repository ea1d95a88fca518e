"""Typed records that cross every boundary of the loop.

``Prompt`` leaves the data source, ``Sample`` is one trajectory produced by rollout and scored by a
reward, ``Group`` holds all samples of one prompt, and ``TrainBatch`` is the packed tensor form the
trainer consumes. Every record carries weight versions so that staleness is computed from data,
never assumed.

This module is a leaf: it imports nothing from Noria. Records are slotted dataclasses; ``Sample``
is mutable because rollout appends to it turn by turn, the others are frozen.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Status(str, enum.Enum):
    """How a trajectory ended."""

    PENDING = "pending"  # not finished yet (in flight)
    COMPLETED = "completed"  # the policy stopped by itself (EOS or a stop string)
    TRUNCATED = "truncated"  # hit the token limit
    ABORTED = "aborted"  # cancelled by the system (shutdown, abort, weight update with retract)
    FAILED = "failed"  # generation, environment or reward raised; ``status_reason`` says why


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt record from a data source."""

    prompt: str | tuple[dict[str, Any], ...]
    """The prompt as text, or as chat messages (``{"role", "content"}`` dicts) to be rendered; a
    content is a string, or a list of text and image parts (``noria.data.vision_chat``)."""
    label: Any = None
    """Reference answer the reward compares against (string, number, or task-specific)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Extra per-row fields kept from the source (task name, difficulty, ...)."""
    index: int = -1
    """Position of the row in its source (0-based), stable across shuffles and epochs."""
    source: str = ""
    """Where the row came from: a file path or ``task:<name>/<split>``."""


@dataclass(slots=True)
class Sample:
    """One trajectory: a prompt, everything after it, and how it was produced and scored.

    Lengths: ``len(response_ids) == len(loss_mask) == len(rollout_logprobs)``; tokens the policy did
    not sample (tool and environment output) have ``loss_mask`` 0 and logprob 0.0.
    """

    prompt_ids: list[int]
    """Token ids of the rendered prompt, shape [P]."""
    response_ids: list[int] = field(default_factory=list)
    """Every token after the prompt, tool and environment tokens included, shape [R]."""
    loss_mask: list[int] = field(default_factory=list)
    """Per response token: 1 if sampled by the policy (trained on), 0 otherwise. Shape [R]."""
    rollout_logprobs: list[float] = field(default_factory=list)
    """Per response token: log-probability under the behaviour policy (natural log). Shape [R]."""
    weight_versions: list[int] = field(default_factory=list)
    """Per response token: weight version of the policy that produced it (-1 for non-policy tokens)."""
    response_text: str = ""
    """Decoded response, for rewards and inspection."""
    reward: float | None = None
    """Scalar reward; None until scored."""
    status: Status = Status.PENDING
    """How the trajectory ended."""
    status_reason: str = ""
    """Why it failed or was aborted (empty otherwise)."""
    group_id: int = -1
    """Id of the group (prompt) this sample belongs to."""
    index: int = 0
    """Index of this sample within its group, 0..n_samples-1."""
    session_id: str | None = None
    """Session (multi-turn conversation) id, also the routing key; None for single-turn work."""
    routed_experts: Any = None
    """MoE routes (``rollout.routing_replay`` / ``record_routes``), or None: an integer tensor
    [R, L, k] (L MoE layers, top-k; int8 up to 128 experts, else int16), row i the experts of the
    forward that sampled response token i (the position before it); rows of non-policy tokens
    hold -1. From an SGLang server: [R, L * k], reshaped by the trainer. Memory: R * L * k bytes in
    int8 (a 32k-token, 48-layer, top-8 sample: 12 MiB)."""
    latents: Any = None
    """Image trajectories (``noria.diffusion``), else None: float32 tensor [T+1, C, H, W], the
    latent at every noise level of the T denoising steps (x_T noise first, x_0 last). An image's
    "tokens" are its steps: ``prompt_ids`` = [class label], ``response_ids`` = step indices 0..T-1,
    ``rollout_logprobs`` = each transition's log-probability, ``weight_versions`` per step."""
    image: Any = None
    """Image trajectories: the generated image, a uint8 numpy array [H, W, C] (what image rewards
    score instead of ``response_text``); None for text."""
    teacher_logprobs: list[float] | None = None
    """On-policy distillation (``train.loss.opd_coef``): per response token, the teacher's
    log-probability of it (natural log, at the rollout temperature); 0.0 where ``loss_mask`` is 0.
    Shape [R]; None until a teacher scored the sample."""
    teacher_top_logprobs: list[list[tuple[int, float]]] | None = None
    """``opd.top_k``: per response token, the teacher's top-k (token id, logprob) at that position
    ([] where ``loss_mask`` is 0); None otherwise."""
    rollout_top_logprobs: list[list[tuple[int, float]]] | None = None
    """``opd.top_k``: per response token, the behaviour policy's top-k (token id, logprob) at that
    position, as the rollout engine reported them ([] for non-policy tokens); None otherwise."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form per-sample data (prompt metadata, reward details, timings)."""
    images: list[str] | None = None
    """Vision-language samples: their input images by content hash (``sha256:<hex>``, the run's image
    store: ``noria.data.images``), in the order of their tokens in ``prompt_ids`` then
    ``response_ids``; None for text (and in records written before images existed)."""
    advantage: float | None = None
    """The sequence-level advantage the trainer weighted this sample with (set by the RL step; None
    before it, for samples not trained, and under GAE, whose advantages are per token)."""

    @property
    def n_policy_tokens(self) -> int:
        """Number of response tokens sampled by the policy."""
        return sum(self.loss_mask)

    @property
    def min_version(self) -> int | None:
        """Oldest weight version of any policy token; None if the sample has none."""
        versions = [v for v, m in zip(self.weight_versions, self.loss_mask) if m]
        return min(versions) if versions else None


@dataclass(frozen=True, slots=True)
class Group:
    """All samples of one prompt; the unit the buffer stores and advantages normalise over."""

    group_id: int
    """Unique id within a run."""
    prompt: Prompt
    """The source prompt record."""
    samples: tuple[Sample, ...]
    """The trajectories, in sample-index order."""

    @property
    def min_version(self) -> int | None:
        """Oldest weight version of any policy token in the group (for staleness)."""
        versions = [v for s in self.samples if (v := s.min_version) is not None]
        return min(versions) if versions else None

    @property
    def rewards(self) -> list[float | None]:
        """Rewards of the samples, in order."""
        return [s.reward for s in self.samples]


@dataclass(frozen=True, slots=True)
class TrainBatch:
    """Samples packed into flat token tensors for the trainer.

    All per-token tensors have shape [N], N being the total number of tokens of all packed
    sequences (prompt and response). Sequence boundaries are ``cu_seqlens``; nothing is reshaped by
    group size, so groups of different sizes and lengths pack the same way.
    """

    input_ids: Any
    """LongTensor [N]: the tokens of every sequence, concatenated."""
    positions: Any
    """LongTensor [N]: position of each token within its own sequence (restarts at 0)."""
    cu_seqlens: Any
    """IntTensor [S+1]: cumulative sequence lengths; sequence i is tokens cu[i]:cu[i+1]."""
    loss_mask: Any
    """FloatTensor [N]: 1 where the token's log-probability is trained (policy response tokens)."""
    rollout_logprobs: Any
    """FloatTensor [N]: behaviour-policy log-probability of each token (0 where loss_mask is 0)."""
    advantages: Any
    """FloatTensor [N]: per-token advantage (0 where loss_mask is 0)."""
    sample_ids: Any
    """LongTensor [S]: index of each packed sequence in the step's list of samples."""
    weight_versions: Any = None
    """LongTensor [N] or None: weight version of each token (-1 for prompt and non-policy tokens)."""
    parents: Any = None
    """LongTensor [N] or None: prefix-tree packing (``noria.train.prefix_tree``). Token t's parent is
    token ``parents[t]`` of the same packed sequence (-1 for each packed sequence's first token): a
    packed sequence is then a tree of several original sequences sharing prefixes, each token
    attending to its ancestors and itself, predicted from its parent. None: every packed sequence
    is plain (each token's parent is the token before it)."""
    seq_ids: Any = None
    """LongTensor [N] or None (with ``parents``): the original sequence that brought each token (a
    token shared by several sequences: the first of them); None means the packed sequence index."""
    routed_experts: Any = None
    """Integer tensor [N, L, k] (or [N, L * k]) or None: the engine's MoE routes of each policy token,
    aligned like every per-token tensor here to the token they PREDICTED (row t: the experts of
    the forward at position t - 1); -1 rows elsewhere."""
    replay_routes: bool = False
    """The trainer's MoE layers use ``routed_experts`` (``rollout.routing_replay``); else they route by
    themselves and only measure the mismatch."""
    pixel_values: Any = None
    """FloatTensor [I, 3, S, S] or None: a vision-language model's images, every sequence's in the
    order of its image tokens, sequence after sequence (``image_counts`` says how many each has)."""
    image_counts: Any = None
    """LongTensor [S] or None: how many of ``pixel_values`` each sequence takes."""
    step_totals: tuple[float, int] | None = None
    """The optimizer step's (loss tokens, sequences with a loss token) when the batch leaves out
    samples whose gradient is zero (``train.skip_zero_advantage``): the losses keep dividing by the
    whole step's counts. None: counted from this batch (``noria.train.backend.step_totals``)."""

    @property
    def n_tokens(self) -> int:
        """Total number of packed tokens N."""
        return int(self.input_ids.numel())

    @property
    def n_sequences(self) -> int:
        """Number of packed sequences S."""
        return int(self.cu_seqlens.numel()) - 1
