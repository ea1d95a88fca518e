"""A training step's metrics: (sum, weight) pairs added up over micro-batches and ranks, reported as
sum / weight. Used by the PyTorch backend (``noria.train.fsdp``), and through it by the Megatron
backend and the critic.

How data moves: each micro-batch's ``LossFn`` returns ``Metrics`` (name -> (sum, weight));
:func:`accumulate_metrics` adds them into the step's sums on each rank; a distributed backend
then sums them over its ranks (:func:`all_reduce_metrics`: the ranks first agree on the names,
since a rank may have nothing to measure); :func:`averaged` reports sum / weight. Names ending in
``_max`` / ``_min`` are extrema: combined with max / min, never added, and reported as they are.
The loss is the backend's own sum and is skipped here.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from noria.train.backend import Metrics

EXTREMA = ("_max", "_min")
"""Metric names ending so are combined with max / min, never added (their weight is 0)."""


def accumulate_metrics(acc: dict[str, list[float]], metrics: Metrics) -> None:
    """Add one micro-batch's (sum, weight) metrics into ``acc``; ``_max`` / ``_min`` keep extrema."""
    for k, (s, w) in metrics.items():
        if k == "loss":
            continue  # the backend sums the loss itself
        if k not in acc:
            acc[k] = [float(s), float(w)]
        elif k.endswith("_max"):
            acc[k][0] = max(acc[k][0], float(s))
        elif k.endswith("_min"):
            acc[k][0] = min(acc[k][0], float(s))
        else:
            acc[k][0] += float(s)
            acc[k][1] += float(w)


def all_reduce_metrics(sums: dict[str, list[float]], world: int, group, device: torch.device) -> dict[str, list[float]]:
    """``sums`` combined over the ``world`` ranks of ``group`` (collective: every rank calls it)."""
    # Ranks may lack a metric (nothing to measure there), so agree on the key set first.
    key_sets: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(key_sets, sorted(sums), group=group)
    keys = sorted(set().union(*key_sets))
    out: dict[str, list[float]] = {}
    for suffix, op, fill in (("_max", dist.ReduceOp.MAX, -math.inf), ("_min", dist.ReduceOp.MIN, math.inf), ("", dist.ReduceOp.SUM, 0.0)):
        names = [k for k in keys if k not in out and k.endswith(suffix)]
        if not names:
            continue
        t = torch.tensor([sums.get(k, [fill, 0.0]) for k in names], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op, group=group)
        out.update(zip(names, t.cpu().tolist()))
    return out


def averaged(sums: dict[str, list[float]]) -> dict[str, float]:
    """sum / weight of each metric by name (extrema as they are; a metric of weight 0 is left out)."""
    out = {}
    for k, (s, w) in sorted(sums.items()):
        if k.endswith(EXTREMA):
            out[k] = s
        elif w:
            out[k] = s / w
    return out
