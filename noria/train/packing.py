"""Samples -> packed ``TrainBatch`` -> token-budget micro-batches.

How data moves: ``pack_groups`` (or ``pack_samples``) concatenates each sample's prompt and
response ids into one sequence and all sequences into flat [N] tensors (``TrainBatch``); nothing is
reshaped by group size. ``plan_micro_batches`` cuts the sequence list into consecutive runs of at
most ``micro_batch_tokens`` tokens, and ``slice_batch`` turns one run into its own ``TrainBatch``.

Alignment (the one thing to get right here): every per-token tensor is aligned to the token it
describes, i.e. the token that is PREDICTED. ``loss_mask[t]``, ``rollout_logprobs[t]`` and
``advantages[t]`` are about ``input_ids[t]``, whose log-probability comes from the logits at
position ``t - 1`` (see ``noria.train.logprobs``). The first token of each sequence has no
prediction, so its mask is 0 even if it is a policy token (a sample with an empty prompt).

MoE routes (``routed_experts``) follow the same alignment; ``replay_rows`` moves them to the
position whose forward used them, which is what the model's ``Routing(replay=...)`` takes.

Not guaranteed: micro-batches keep the sequence order of the batch; they are not balanced by
attention cost (sum of L^2), only by token count.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from noria.types import Group, Sample, TrainBatch

Advantage = float | Sequence[float]
"""One number for the whole response, or one per response token (GAE-style)."""


def pack_groups(
    groups: Sequence[Group], advantages: Sequence[Sequence[Advantage]] | None = None, replay_routes: bool = False
) -> TrainBatch:
    """Pack every sample of every group, in order; ``advantages[g][i]`` belongs to sample i of group g."""
    samples = [s for g in groups for s in g.samples]
    flat = None
    if advantages is not None:
        if len(advantages) != len(groups) or any(len(a) != len(g.samples) for a, g in zip(advantages, groups)):
            raise ValueError("advantages must have one entry per sample of each group")
        flat = [a for per_group in advantages for a in per_group]
    return pack_samples(samples, flat, replay_routes)


def pack_samples(
    samples: Sequence[Sample], advantages: Sequence[Advantage] | None = None, replay_routes: bool = False,
    pixel_values: Sequence[torch.Tensor | None] | None = None,
) -> TrainBatch:
    """Pack samples (prompt + response per sequence) into flat tensors; see the module docstring.
    Samples with MoE routes give ``routed_experts`` (``replay_routes``: the trainer uses them).
    ``pixel_values``: a vision-language model's images of each sample ([n, 3, S, S] in the order of
    its image tokens, or None), packed into ``TrainBatch.pixel_values`` / ``image_counts``."""
    if not samples:
        raise ValueError("cannot pack an empty list of samples")
    if advantages is not None and len(advantages) != len(samples):
        raise ValueError(f"got {len(advantages)} advantages for {len(samples)} samples")
    cols: dict[str, list] = {k: [] for k in ("ids", "pos", "mask", "lp", "adv", "ver")}
    lens = []
    for i, s in enumerate(samples):
        _check_sample(i, s)
        adv = 0.0 if advantages is None else advantages[i]
        _append_sample(cols, s, adv)
        lens.append(len(s.prompt_ids) + len(s.response_ids))
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    return TrainBatch(
        input_ids=torch.tensor(cols["ids"], dtype=torch.long),
        positions=torch.tensor(cols["pos"], dtype=torch.long),
        cu_seqlens=cu,
        loss_mask=torch.tensor(cols["mask"], dtype=torch.float32),
        rollout_logprobs=torch.tensor(cols["lp"], dtype=torch.float32),
        advantages=torch.tensor(cols["adv"], dtype=torch.float32),
        sample_ids=torch.arange(len(samples), dtype=torch.long),
        weight_versions=torch.tensor(cols["ver"], dtype=torch.long),
        routed_experts=pack_routes(samples, cols["mask"]),
        replay_routes=replay_routes,
        **pack_images(pixel_values, len(samples)),
    )


def pack_images(pixel_values: Sequence[torch.Tensor | None] | None, n: int) -> dict[str, torch.Tensor]:
    """``pixel_values`` and ``image_counts`` of a batch of ``n`` samples (empty when none has images)."""
    if pixel_values is None or all(p is None for p in pixel_values):
        return {}
    if len(pixel_values) != n:
        raise ValueError(f"got pixel_values for {len(pixel_values)} samples, packing {n}")
    counts = torch.tensor([0 if p is None else p.shape[0] for p in pixel_values], dtype=torch.long)
    return {"pixel_values": torch.cat([p for p in pixel_values if p is not None]), "image_counts": counts}


def pack_routes(samples: Sequence[Sample], mask: list[int]) -> torch.Tensor | None:
    """[N, ...] routes of the packed tokens (``TrainBatch.routed_experts``): each sample's response
    rows where the token is trained, -1 elsewhere; None when no sample has routes."""
    routed = [s.routed_experts for s in samples if s.routed_experts is not None]
    if not routed:
        return None
    tail = tuple(routed[0].shape[1:])
    dtype = functools.reduce(torch.promote_types, (r.dtype for r in routed))
    out = torch.full((len(mask), *tail), -1, dtype=dtype)
    offset = 0
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        if s.routed_experts is not None:
            if tuple(s.routed_experts.shape) != (r, *tail):
                raise ValueError(
                    f"sample {i}: routed_experts has shape {tuple(s.routed_experts.shape)}, expected {(r, *tail)} "
                    "(one row per response token, like the other samples)"
                )
            out[offset + p : offset + p + r] = s.routed_experts
        offset += p + r
    out[torch.tensor(mask) == 0] = -1  # prompt and environment tokens route by themselves
    return out


def _check_sample(i: int, s: Sample) -> None:
    r = len(s.response_ids)
    if len(s.loss_mask) != r:
        raise ValueError(f"sample {i}: {r} response ids but {len(s.loss_mask)} loss_mask entries")
    if s.rollout_logprobs and len(s.rollout_logprobs) != r:
        raise ValueError(f"sample {i}: {r} response ids but {len(s.rollout_logprobs)} rollout_logprobs")
    if s.weight_versions and len(s.weight_versions) != r:
        raise ValueError(f"sample {i}: {r} response ids but {len(s.weight_versions)} weight_versions")
    if len(s.prompt_ids) + r == 0:
        raise ValueError(f"sample {i} has no tokens")


def _append_sample(cols: dict[str, list], s: Sample, adv: Advantage) -> None:
    p, r = len(s.prompt_ids), len(s.response_ids)
    mask = [int(m) for m in s.loss_mask]
    if p == 0 and r:
        mask[0] = 0  # the first token of a sequence is never predicted
    if isinstance(adv, (int, float)):
        adv_tokens = [float(adv) * m for m in mask]
    else:
        if len(adv) != r:
            raise ValueError(f"per-token advantages have length {len(adv)}, response has {r} tokens")
        adv_tokens = [float(a) * m for a, m in zip(adv, mask)]
    lps = list(s.rollout_logprobs) or [0.0] * r
    vers = list(s.weight_versions) or [-1] * r
    cols["ids"] += list(s.prompt_ids) + list(s.response_ids)
    cols["pos"] += list(range(p + r))
    cols["mask"] += [0] * p + mask
    cols["lp"] += [0.0] * p + [lp * m for lp, m in zip(lps, mask)]
    cols["adv"] += [0.0] * p + adv_tokens
    cols["ver"] += [-1] * p + [v if m else -1 for v, m in zip(vers, mask)]


def seq_lens(batch: TrainBatch) -> list[int]:
    """Length of each packed sequence."""
    return torch.diff(batch.cu_seqlens).tolist()


def seq_index(batch: TrainBatch) -> torch.Tensor:
    """LongTensor [N]: index of each token's original sequence within the batch (0, 1, ...).

    With prefix trees (``batch.seq_ids``: the sequence that brought each token) the original
    sequences are renumbered from 0 in order, so the values stay below N in any slice of the batch."""
    if batch.seq_ids is not None:
        return torch.unique(batch.seq_ids, return_inverse=True)[1]
    lens = torch.diff(batch.cu_seqlens).long()
    return torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)


def prediction_sources(
    cu_seqlens: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst) LongTensors: token ``dst[i]`` is predicted by the logits at position ``src[i]``.

    Plain sequences: ``src = dst - 1`` for every token but the first of each sequence. Prefix
    trees (``parents``, ``noria.train.prefix_tree``): every token but a root is predicted from its
    parent, so the token after a branch point is predicted from the node all branches share."""
    pos = positions.long()
    n = pos.numel()
    cu = cu_seqlens.long().to(pos.device)
    lens = torch.diff(cu)
    if parents is None:
        src = torch.arange(-1, n - 1, device=pos.device)
        first = torch.zeros(n, dtype=torch.bool, device=pos.device)
        first[cu[:-1][lens > 0]] = True
    else:
        parents = parents.long().to(pos.device)
        src = torch.repeat_interleave(cu[:-1], lens) + parents
        first = parents < 0
    dst = (~first).nonzero().squeeze(-1)
    return src[dst], dst


def plan_micro_batches(batch: TrainBatch, max_tokens: int) -> list[tuple[int, int]]:
    """Consecutive sequence ranges [start, end) of at most ``max_tokens`` tokens each.

    A sequence longer than the budget gets a micro-batch of its own (never split: attention needs
    the whole sequence).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    ranges, start, used = [], 0, 0
    for i, n in enumerate(seq_lens(batch)):
        if i > start and used + n > max_tokens:
            ranges.append((start, i))
            start, used = i, 0
        used += n
    ranges.append((start, batch.n_sequences))
    return ranges


def slice_batch(batch: TrainBatch, start: int, end: int) -> TrainBatch:
    """Sequences [start, end) of ``batch`` as a batch of their own (cu_seqlens rebased to 0)."""
    cu = batch.cu_seqlens
    lo, hi = int(cu[start]), int(cu[end])

    def cut(t):
        return None if t is None else t[lo:hi]

    return TrainBatch(
        input_ids=cut(batch.input_ids),
        positions=cut(batch.positions),
        cu_seqlens=cu[start : end + 1] - lo,
        loss_mask=cut(batch.loss_mask),
        rollout_logprobs=cut(batch.rollout_logprobs),
        advantages=cut(batch.advantages),
        sample_ids=batch.sample_ids[start:end],
        weight_versions=cut(batch.weight_versions),
        parents=cut(batch.parents),
        seq_ids=cut(batch.seq_ids),
        routed_experts=cut(batch.routed_experts),
        replay_routes=batch.replay_routes,
        **_images_of(batch, start, end),
    )


def take_sequences(batch: TrainBatch, seqs: torch.Tensor) -> tuple[TrainBatch, torch.Tensor]:
    """Sequences ``seqs`` (LongTensor, in the order given) of a plainly packed batch as a batch of
    their own, and the rows of their tokens in ``batch``."""
    if batch.parents is not None or batch.image_counts is not None:
        raise ValueError("take_sequences takes a plainly packed text batch")
    cu = batch.cu_seqlens.long()
    lens = (cu[1:] - cu[:-1])[seqs]
    starts = torch.repeat_interleave(cu[:-1][seqs], lens)
    offsets = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    rows = starts + torch.arange(int(lens.sum())) - offsets
    new_cu = torch.zeros(len(seqs) + 1, dtype=batch.cu_seqlens.dtype)
    new_cu[1:] = torch.cumsum(lens, 0)

    def take(t):
        return None if t is None else t[rows]

    part = TrainBatch(
        input_ids=take(batch.input_ids),
        positions=take(batch.positions),
        cu_seqlens=new_cu,
        loss_mask=take(batch.loss_mask),
        rollout_logprobs=take(batch.rollout_logprobs),
        advantages=take(batch.advantages),
        sample_ids=batch.sample_ids[seqs],
        weight_versions=take(batch.weight_versions),
        routed_experts=take(batch.routed_experts),
        replay_routes=batch.replay_routes,
    )
    return part, rows


def _images_of(batch: TrainBatch, start: int, end: int) -> dict[str, torch.Tensor]:
    if batch.image_counts is None:
        return {}
    first, last = int(batch.image_counts[:start].sum()), int(batch.image_counts[:end].sum())
    if first == last:  # no image among these sequences: a text batch
        return {}
    return {"pixel_values": batch.pixel_values[first:last], "image_counts": batch.image_counts[start:end]}


def batch_to(batch: TrainBatch, device: torch.device | str) -> TrainBatch:
    """The same batch with every tensor on ``device``."""
    moved = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return TrainBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


def replay_rows(batch: TrainBatch) -> torch.Tensor | None:
    """``routed_experts`` moved to the position whose forward each route belongs to: [N, ...], row t
    the route of the forward at position t (the one predicting ``prediction_sources``' target),
    -1 where none was recorded. In a prefix tree several tokens may be predicted from one node;
    they carry the same route (``noria.train.prefix_tree`` shares a token only then)."""
    routes = batch.routed_experts
    if routes is None:
        return None
    src, dst = prediction_sources(batch.cu_seqlens, batch.positions, batch.parents)
    src, dst = src.to(routes.device), dst.to(routes.device)
    has = routes.reshape(len(routes), -1)[dst, 0] >= 0
    src, order = torch.sort(src[has], stable=True)
    dst = dst[has][order]
    first = torch.ones_like(src, dtype=torch.bool)
    first[1:] = src[1:] != src[:-1]
    out = torch.full_like(routes, -1)
    out[src[first]] = routes[dst[first]]
    return out


@dataclass(frozen=True)
class MicroBatchPlan:
    """Which micro-batches a rank runs: sequence ranges, padded so every rank runs the same count.

    FSDP ranks must run the same number of forward/backward passes (each runs collectives), so a
    rank with fewer micro-batches repeats one with ``scale`` 0 (its loss is multiplied by 0).
    """

    ranges: list[tuple[int, int]]
    scales: list[float]


def plan_for_rank(batch: TrainBatch, max_tokens: int, rank: int, world_size: int) -> MicroBatchPlan:
    """Micro-batches of ``rank``: global token-budget micro-batches dealt out greedily by tokens."""
    ranges = plan_micro_batches(batch, max_tokens)
    cu = batch.cu_seqlens.tolist()
    load = [0] * world_size
    owned: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
    # Largest first onto the least-loaded rank; ties go to the lowest rank, so it is deterministic.
    for r in sorted(ranges, key=lambda r: (-(cu[r[1]] - cu[r[0]]), r[0])):
        k = min(range(world_size), key=lambda j: (load[j], j))
        owned[k].append(r)
        load[k] += cu[r[1]] - cu[r[0]]
    count = max(len(o) for o in owned)
    mine = sorted(owned[rank])
    scales = [1.0] * len(mine)
    while len(mine) < count:
        mine.append(min(ranges, key=lambda r: cu[r[1]] - cu[r[0]]))
        scales.append(0.0)
    return MicroBatchPlan(mine, scales)
