"""Rollout of one step: prompts -> groups of scored trajectories, on any ``EngineClient``.

How data moves::

    Prompt --render (chat template)--> prompt ids --n_samples x generate fn--> Samples
           --reward runner (timeouts -> FAILED)--> Group(samples in index order)

``generate_one(ctx, sample)`` is the default generate function (DESIGN.md section 3): it sends the
sample's ``prompt_ids`` to the engine and records the engine's own tokens, log-probabilities and
weight versions, so the trainer sees exactly what was sampled. Every sample of a step is in flight
at once; the engine batches them continuously.

Seeds: each sample's sampling seed is a pure function of (run seed, group id, sample index), so a
run repeated (or resumed) on a deterministic engine samples the same tokens.

Failure: an engine failure (``EngineFailure``) propagates and stops the step, with the engine's
name in the message. A sample the engine aborted is kept with status ABORTED (excluded from
training, counted); a reward failure is status FAILED (excluded from advantages, counted).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from noria.config import RewardConfig, RolloutConfig
from noria.engine.protocol import GenerateRequest, SamplingParams
from noria.rewards.runner import ScoreCounts, score_groups_async
from noria.rollout.client import EngineClient
from noria.types import Group, Prompt, Sample, Status

GenerateFn = Callable[["RolloutContext", Sample], Awaitable[Sample]]


@dataclass
class RolloutContext:
    """What a generate function may use: the engine, the tokenizer and the sampling settings."""

    engine: EngineClient
    tokenizer: Any
    sampling: RolloutConfig
    seed: int = 0
    greedy: bool = False
    """Evaluation: temperature 0 whatever ``sampling`` says."""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutResult:
    """The groups of one rollout step and what producing them measured."""

    groups: list[Group]
    counts: ScoreCounts
    seconds: float
    reward_seconds: float


def sample_seed(seed: int, group_id: int, index: int) -> int:
    """The sampling seed of sample ``index`` of group ``group_id`` (63-bit, stable across runs)."""
    return (seed * 1_000_003 + group_id * 4_099 + index) % (1 << 62)


def sampling_params(ctx: RolloutContext, sample: Sample) -> SamplingParams:
    cfg = ctx.sampling
    if ctx.greedy:
        return SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=0.0, stop=list(cfg.stop))
    return SamplingParams(
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        min_p=cfg.min_p,
        stop=list(cfg.stop),
        seed=sample_seed(ctx.seed, sample.group_id, sample.index),
    )


async def generate_one(ctx: RolloutContext, sample: Sample) -> Sample:
    """The default generate function: one single-turn trajectory from the engine."""
    req = GenerateRequest(input_ids=list(sample.prompt_ids), sampling=sampling_params(ctx, sample))
    out = await ctx.engine.generate(req)
    reason = (out.finish_reason or {}).get("type")
    sample.response_ids = list(out.output_ids)
    sample.loss_mask = [1] * len(out.output_ids)
    sample.rollout_logprobs = [float(x) for x in out.logprobs]
    sample.weight_versions = list(out.weight_versions)
    sample.response_text = ctx.tokenizer.decode(out.output_ids, skip_special_tokens=True)
    sample.status = {"stop": Status.COMPLETED, "length": Status.TRUNCATED}.get(reason, Status.ABORTED)
    if sample.status is Status.ABORTED:
        sample.status_reason = str((out.finish_reason or {}).get("message", "aborted by the engine"))
    sample.metadata["cached_tokens"] = out.cached_tokens
    return sample


async def rollout_groups(
    ctx: RolloutContext,
    prompts: Sequence[tuple[Prompt, list[int]]],
    first_group_id: int,
    n_samples: int,
    reward: RewardConfig,
    generate: GenerateFn = generate_one,
) -> RolloutResult:
    """``n_samples`` trajectories for each (prompt, prompt ids), generated together and scored."""
    start = time.perf_counter()
    groups_samples = [
        [
            Sample(prompt_ids=list(ids), group_id=first_group_id + g, index=i, metadata=dict(prompt.metadata))
            for i in range(n_samples)
        ]
        for g, (prompt, ids) in enumerate(prompts)
    ]
    tasks = [asyncio.ensure_future(generate(ctx, s)) for samples in groups_samples for s in samples]
    try:
        await asyncio.gather(*tasks)
    finally:  # on an engine failure, stop the rest before the error propagates
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    groups = [
        Group(group_id=first_group_id + g, prompt=prompt, samples=tuple(samples))
        for g, ((prompt, _), samples) in enumerate(zip(prompts, groups_samples))
    ]
    reward_start = time.perf_counter()
    counts = await score_groups_async(groups, reward)
    now = time.perf_counter()
    return RolloutResult(groups, counts, now - start, now - reward_start)
