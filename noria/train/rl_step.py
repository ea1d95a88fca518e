"""The RL training step: one rollout step's groups -> ``train.steps_per_rollout`` optimizer steps.

Every launcher runs this same step (``noria.loop.Job.train`` calls it; on several trainer ranks,
every rank calls it with the same groups and the backend splits the work)::

    groups --trainable (completed or truncated, and scored)--> samples
      GRPO family (train.loss.advantage != gae):
        advantages per group (noria.train.algorithms, by name) -> K slices of samples, in order
        -> pack each slice (samples with a zero gradient left out: ``pack_step``) -> K > 1: every slice's logprobs under the weights BEFORE the first update
           (the "old" policy of the ratio) -> K backend.train_step calls
      PPO with GAE (advantage: gae): noria.train.critic.ppo_train (the critic gives per-token
        advantages; K slices likewise, policy and critic stepped together)
    -> metrics: the mean over the K optimizer steps (extrema kept, counters last), the samples
       trained, token staleness, the time taken

With K = 1 there is no recomputation: the policy that generated is the one being trained, and the
backend uses the current logprobs (detached) as the old ones. Off-policy correction against the
rollout engine's logprobs is the objective's job (``train.loss.off_policy``).

Blocking: the whole step runs on the calling thread (the loop calls it through
``asyncio.to_thread``); under FSDP2 every rank must call it with the same groups. On CUDA the
calling thread's current device is made the trainer's (``on_device``).

On-policy distillation (``train.loss.opd_coef`` > 0): before slicing, the advantages become per
token, ``A_t - lambda * kl_t`` (``noria.train.opd``; the trainer's frozen teacher scores samples no
teacher engine did).

Not guaranteed: a step with no trainable sample trains nothing; it reports
``train/skipped_no_samples`` instead (the buffer already drops groups without one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

from noria.config import TrainConfig
from noria.process.usage import release_free_memory
from noria.types import Group, Sample, Status, TrainBatch


def rl_step(
    backend: Any, groups: Sequence[Group], cfg: TrainConfig, weight_version: int, critic: Any = None,
    replay_routes: bool = False, opd: Any = None, pixels: Any = None,
) -> dict[str, float]:
    """``cfg.steps_per_rollout`` optimizer steps of ``backend`` (and ``critic`` for PPO with GAE) on the
    groups' trainable samples; ``weight_version`` is the version the engines serve (for the
    staleness metric); ``replay_routes``: the MoE layers use the samples' recorded routes
    (``rollout.routing_replay``); ``opd``: the ``opd`` section when distilling
    (``train.loss.opd_coef`` > 0, ``noria.train.opd``); ``pixels``: a vision-language model's images
    of the samples (``noria.train.images.SamplePixels``). Returns the step's metrics (see the module docstring)."""
    from noria import faults

    faults.point("train.step")
    with on_device(backend.device):
        metrics = _rl_step(backend, groups, cfg, weight_version, critic, replay_routes, opd, pixels)
    release_free_memory()  # the step's freed activations and logit chunks leave the C heap's arenas
    return metrics


def _rl_step(
    backend: Any, groups: Sequence[Group], cfg: TrainConfig, weight_version: int, critic: Any, replay_routes: bool,
    opd: Any = None, pixels: Any = None,
) -> dict[str, float]:
    from noria.train import pack_samples
    from noria.train.algorithms import compute_advantages

    t0 = time.perf_counter()
    kept = [g for g in (trainable(g) for g in groups) if g]
    samples = [s for g in kept for s in g]
    if not samples:
        return {"time/train_s": time.perf_counter() - t0, "train/skipped_no_samples": 1.0}
    k = cfg.steps_per_rollout
    extra: dict[str, float] = {}
    if critic is not None:
        from noria.train.critic import ppo_train

        batch = pack_samples(samples, replay_routes=replay_routes, pixel_values=pixels(samples) if pixels else None)
        parts = ppo_train(backend, critic, samples, cfg, k, batch=batch)
        batches = [batch]
    else:
        advantages = compute_advantages(cfg.loss, [[s.reward for s in g] for g in kept])
        flat_adv = [a for per_group in advantages for a in per_group]
        for sample, advantage in zip(samples, flat_adv):  # kept for the rollouts file (noria inspect)
            sample.advantage = float(advantage)
        if cfg.loss.opd_coef > 0:  # on-policy distillation: per-token advantages (noria.train.opd)
            flat_adv, extra = distill_advantages(backend, samples, flat_adv, cfg, opd)
        size = math.ceil(len(samples) / k)
        slices = [(samples[i : i + size], flat_adv[i : i + size]) for i in range(0, len(samples), size)]
        batches = [pack_step(s, a, cfg, replay_routes, pixels) for s, a in slices]
        old = [backend.compute_logprobs(b).logprobs for b in batches] if len(batches) > 1 else [None]
        parts = [backend.train_step(b, old_logprobs=o) for b, o in zip(batches, old)]
        for part, (chosen, _) in zip(parts, slices):  # the step's work, samples left out included (train tok/s)
            part["tokens"] = float(sum(len(x.prompt_ids) + len(x.response_ids) for x in chosen))
        skipped = len(samples) - sum(b.n_sequences for b in batches)
        extra["train/zero_advantage_skipped_frac"] = skipped / len(samples)
        if skipped:  # staleness over every sample of the step, those left out too
            batches = [pack_samples(samples)]
    out = average(parts)
    out.update(extra)
    out["optimizer_step"] = out.pop("step", float(backend.optimizer_steps))
    out["train/samples"] = float(len(samples))
    out.update(token_staleness(batches, weight_version))
    out["time/train_s"] = time.perf_counter() - t0
    return out


def pack_step(
    samples: list[Sample], advantages: list, cfg: TrainConfig, replay_routes: bool = False, pixels: Any = None
) -> TrainBatch:
    """One optimizer step's batch of ``samples``. With ``train.skip_zero_advantage``, the samples whose
    gradient is zero (:func:`zero_gradient`) are left out and the batch carries the whole step's
    normalisers (``TrainBatch.step_totals``): the same gradient, without their forward and backward.
    One sample (the shortest with a trained token) stays when none has a gradient, so the optimizer
    steps as it would."""
    from noria.train import pack_samples
    from noria.train.backend import step_totals

    keep = list(range(len(samples)))
    if cfg.skip_zero_advantage and not _other_terms(cfg):
        keep = [i for i, a in enumerate(advantages) if not zero_gradient(a)] or [min(keep, key=lambda i: _cost(samples[i]))]
    totals = step_totals(pack_samples(samples, advantages)) if len(keep) < len(samples) else None
    chosen = [samples[i] for i in keep]
    batch = pack_samples(chosen, [advantages[i] for i in keep], replay_routes, pixel_values=pixels(chosen) if pixels else None)
    return batch if totals is None else dataclasses.replace(batch, step_totals=totals)


def _cost(s: Sample) -> tuple[bool, int]:
    """Order of the samples to keep when none has a gradient: one with a trained token, the shortest."""
    trained = any(s.loss_mask[0 if s.prompt_ids else 1 :])  # a sequence's first token is never predicted
    return not trained, len(s.prompt_ids) + len(s.response_ids)


def zero_gradient(advantage: Any) -> bool:
    """True when a sample's advantage (a number, or one per response token) is 0 everywhere: every
    policy loss (``noria.train.algorithms.policy``) scales the sample's terms by it."""
    if isinstance(advantage, (int, float)):
        return advantage == 0
    return all(a == 0 for a in advantage)


def _other_terms(cfg: TrainConfig) -> bool:
    """Loss terms that may give a token a gradient whatever its advantage: KL, entropy, the MoE
    router's balance, or a policy loss not known to scale every term by the advantage."""
    from noria.train.algorithms.policy import ADVANTAGE_SCALED

    loss = cfg.loss
    return loss.kl_coef > 0 or loss.entropy_coef > 0 or loss.router_aux_coef > 0 or loss.policy_loss not in ADVANTAGE_SCALED


def distill_advantages(
    backend: Any, samples: list[Sample], advantages: list[float], cfg: TrainConfig, opd: Any
) -> tuple[list, dict[str, float]]:
    """The teacher's logprobs (the trainer's frozen teacher scores samples a teacher engine did not),
    then per-token advantages ``A - opd_coef * kl_t`` and the ``opd/*`` metrics."""
    from noria.train import opd as distillation

    seconds = distillation.score_in_trainer(backend, samples)
    shaped, metrics = distillation.shape_advantages(
        samples, advantages, cfg.loss.opd_coef, bool(getattr(opd, "pure", False)), int(getattr(opd, "top_k", 0))
    )
    metrics.update(distillation.teacher_latency(samples))
    if seconds:
        metrics["time/teacher_s"] = seconds
    return shaped, metrics


def trainable(group: Group) -> list[Sample]:
    """The samples of ``group`` that can be trained on: generated to the end and scored."""
    return [s for s in group.samples if s.status in (Status.COMPLETED, Status.TRUNCATED) and s.reward is not None]


def average(parts: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each metric over optimizer steps (max / min for extrema, the last value for counters)."""
    if len(parts) == 1:
        return dict(parts[0])
    out: dict[str, float] = {}
    for key in parts[0]:
        values = [p[key] for p in parts if key in p]
        if key.endswith("_max"):
            out[key] = max(values)
        elif key.endswith("_min"):
            out[key] = min(values)
        elif key in ("step", "lr"):
            out[key] = values[-1]
        else:
            out[key] = sum(values) / len(values)
    return out


def token_staleness(batches: Sequence[TrainBatch], weight_version: int) -> dict[str, float]:
    """Over the trained policy tokens (``TrainBatch.weight_versions`` >= 0): mean and largest
    ``weight_version`` minus the version that sampled the token. Group staleness (the buffer's)
    looks at a group's oldest token; this shows how much of a batch is old when rollouts span
    several versions (asynchronous RL, partial rollouts)."""
    lags = []
    for b in batches:
        if b.weight_versions is None:
            continue
        versions = b.weight_versions[(b.loss_mask > 0) & (b.weight_versions >= 0)]
        lags.append((weight_version - versions).clamp(min=0))
    n = sum(int(x.numel()) for x in lags)
    if n == 0:
        return {}
    return {
        "train/token_staleness_mean": float(sum(float(x.sum()) for x in lags) / n),
        "train/token_staleness_max": float(max(int(x.max()) for x in lags if x.numel())),
    }


def on_device(device: Any) -> contextlib.AbstractContextManager:
    """The trainer's CUDA device as the current one for the calling thread (worker threads start on
    cuda:0; code that means "the current device" then means the trainer's, e.g. on cuda:1)."""
    if getattr(device, "type", "cpu") != "cuda":
        return contextlib.nullcontext()
    import torch

    return torch.cuda.device(device)
