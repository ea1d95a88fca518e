"""Rollout of one step: prompts -> groups of scored trajectories, on any ``EngineClient``.

How data moves::

    Prompt --render (chat template)--> prompt ids --n_samples x generate fn--> Samples
           --reward runner (timeouts -> FAILED)--> Group(samples in index order)

``run_rollout`` picks the plug-in layer the config names (``rollout.rollout_fn``, ``generate_fn``
or ``agent_fn``; see ``noria.agent.plugins``); with none, ``rollout_groups`` with ``generate_one``.
An agent function runs behind a session server started for the call (``noria.agent.session``); the
servers of one rollout context share its bounds' counters (``ctx.extra["session_counters"]``, the
``session/*`` metrics).
Samples a plug-in already scored keep their reward; the others are scored by the reward runner.

``generate_one(ctx, sample)`` is the default generate function (``noria.plugins``): it sends the
sample's ``prompt_ids`` to the engine and records the engine's own tokens, log-probabilities and
weight versions (and MoE routes, with ``rollout.routing_replay`` / ``record_routes``), so the
trainer sees exactly what was sampled. Every sample of a step is in flight
at once; the engine batches them continuously.

Seeds: each sample's sampling seed is a pure function of (run seed, group id, sample index), so a
run repeated (or resumed) on a deterministic engine samples the same tokens.

Failure: an engine failure (``EngineFailure``) propagates and stops the step, with the engine's
name in the message. A sample the engine aborted is kept with status ABORTED (excluded from
training, counted); a reward failure is status FAILED (excluded from advantages, counted).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from noria import faults
from noria.config import RewardConfig, RolloutConfig
from noria.data.vision_chat import image_data, prompt_images
from noria.engine.protocol import GenerateRequest, SamplingParams
from noria.plugins import PluginError, load_plugin
from noria.rewards.runner import ScoreCounts, score_async
from noria.rollout.client import EngineClient
from noria.rollout.in_flight import LiveRequests
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
    first_group_id: int = 0
    """Id of the first group of the current rollout call (rollout functions number groups from it)."""
    prompts: dict[int, Prompt] = field(default_factory=dict)
    """The prompt record of each group id in the current rollout call (agent functions receive it)."""
    session_server: Any = None
    """The session server agent functions talk to (set by ``run_rollout`` when ``rollout.agent_fn`` is set)."""
    top_logprobs: int = 0
    """Record the engine's top-k logprobs of every sampled token (``Sample.rollout_top_logprobs``;
    ``opd.top_k``); 0 records none."""
    processor: Any = None
    """A vision-language model's processor (agent sessions render image parts with it); None for text."""
    live: LiveRequests | None = None
    """The gate a checkpoint closes to stop every request with its tokens (``noria.rollout.in_flight``;
    ``rollout.resume_in_flight`` continue); None: requests go straight to the engine."""
    max_groups: int | None = None
    """Groups ``rollout_groups`` generates at once, at most (an evaluation's ``eval.batch_size``: the
    engine's KV cache is sized for it); None: all of them."""

    def seed_for(self, sample: Sample) -> int:
        """The sampling seed of ``sample`` (``sample_seed`` of the run seed, its group id and index):
        plug-ins that start their own requests (agent sessions) draw the same seeds as the built-in."""
        return sample_seed(self.seed, sample.group_id, sample.index)


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
        seed=ctx.seed_for(sample),
    )


async def generate_one(ctx: RolloutContext, sample: Sample) -> Sample:
    """The default generate function: one single-turn trajectory from the engine. A sample that
    already holds response tokens (stopped by a checkpoint, or recorded in one and resumed:
    ``noria.rollout.in_flight``) continues from them (``next_request``); they keep their logprobs,
    versions and routes."""
    while True:
        seam = len(sample.response_ids)
        if seam and seam >= ctx.sampling.max_new_tokens:  # recorded at the limit: nothing left to sample
            return finish_sample(ctx, sample, {"type": "length"})
        req = next_request(ctx, sample)
        if seam:
            faults.point("rollout.in_flight_continued")
        out = await (ctx.live.generate(ctx.engine, req) if ctx.live is not None else ctx.engine.generate(req))
        append_output(ctx, sample, out)
        if seam == 0:
            sample.metadata["cached_tokens"] = out.cached_tokens
        stop = seam_stop(ctx, sample, seam)
        if stop is not None:
            return finish_sample(ctx, sample, {"type": "stop", "matched": stop})
        if ctx.live is not None and ctx.live.stopped(out):
            await ctx.live.gate()  # a checkpoint records the tokens so far; then they are continued
            continue
        return finish_sample(ctx, sample, out.finish_reason)


def next_request(ctx: RolloutContext, sample: Sample) -> GenerateRequest:
    """The request that samples the rest of ``sample``: its prompt followed by the response so far
    (re-prefilled), for the tokens left of ``max_new_tokens``, seeded apart from the first request."""
    done = len(sample.response_ids)
    sampling = sampling_params(ctx, sample)
    if done:
        sampling.max_new_tokens -= done
        if sampling.seed is not None:
            sampling.seed = (sampling.seed + done * 7_919) % (1 << 62)
    rid = f"noria-g{sample.group_id}-s{sample.index}-{uuid.uuid4().hex[:12]}" if ctx.live is not None else ""
    return GenerateRequest(
        input_ids=list(sample.prompt_ids) + list(sample.response_ids), sampling=sampling, rid=rid,
        return_routed_experts=getattr(ctx.sampling, "wants_routes", False), top_logprobs_num=ctx.top_logprobs,
        image_data=image_data(sample.images) if sample.images else [],
    )  # fmt: skip


def append_output(ctx: RolloutContext, sample: Sample, out: Any) -> None:
    """Add the engine's tokens, logprobs, versions (and routes, top logprobs) to ``sample``'s."""
    if not sample.response_ids:
        sample.routed_experts = out.routed_experts
    elif out.routed_experts is not None and sample.routed_experts is not None:
        import torch

        sample.routed_experts = torch.cat([sample.routed_experts, out.routed_experts])
    sample.response_ids += list(out.output_ids)
    sample.loss_mask += [1] * len(out.output_ids)
    sample.rollout_logprobs += [float(x) for x in out.logprobs]
    sample.weight_versions += list(out.weight_versions)
    if ctx.top_logprobs:
        sample.rollout_top_logprobs = (sample.rollout_top_logprobs or []) + [list(step) for step in out.top_logprobs or []]


def seam_stop(ctx: RolloutContext, sample: Sample, seam: int) -> str | None:
    """A stop string that ends within the window after ``seam`` (the tokens before it came from an
    earlier request, whose own stop check never saw the ones after): the engine's check
    (``noria.engine.scheduler.StopChecker``, a decoded tail window) at each token there; the response
    is cut after the first token that completes one."""
    stops = ctx.sampling.stop
    if not stops or seam == 0:
        return None
    ids, window = sample.response_ids, 4 * max(len(s) for s in stops) + 4
    for k in range(seam, min(len(ids), seam + window)):
        tail = ctx.tokenizer.decode(ids[max(0, k + 1 - window) : k + 1], skip_special_tokens=True)
        hit = next((s for s in stops if s in tail), None)
        if hit is not None:
            for name in ("response_ids", "loss_mask", "rollout_logprobs", "weight_versions", "rollout_top_logprobs", "routed_experts"):
                if getattr(sample, name) is not None:
                    setattr(sample, name, getattr(sample, name)[: k + 1])
            return hit
    return None


def finish_sample(ctx: RolloutContext, sample: Sample, finish_reason: dict[str, Any] | None) -> Sample:
    """Status and text of a trajectory that ended for ``finish_reason`` (the engine's)."""
    reason = (finish_reason or {}).get("type")
    sample.response_text = ctx.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    sample.status = {"stop": Status.COMPLETED, "length": Status.TRUNCATED}.get(reason, Status.ABORTED)
    if sample.status is Status.ABORTED:
        sample.status_reason = str((finish_reason or {}).get("message", "aborted by the engine"))
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
    ctx.first_group_id = first_group_id
    ctx.prompts.update({first_group_id + g: prompt for g, (prompt, _) in enumerate(prompts)})
    groups_samples = [
        [
            Sample(prompt_ids=list(ids), group_id=first_group_id + g, index=i, metadata=dict(prompt.metadata), images=prompt_images(prompt) or None)
            for i in range(n_samples)
        ]
        for g, (prompt, ids) in enumerate(prompts)
    ]
    limit = asyncio.Semaphore(ctx.max_groups or len(groups_samples) or 1)

    async def group(samples: list[Sample]) -> None:  # its samples together, once one of max_groups places is free
        async with limit:
            await asyncio.gather(*(generate(ctx, s) for s in samples))

    tasks = [asyncio.ensure_future(group(samples)) for samples in groups_samples]
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
    counts = await score_unscored(groups, reward)
    now = time.perf_counter()
    return RolloutResult(groups, counts, now - start, now - reward_start)


async def score_unscored(groups: Sequence[Group], reward: RewardConfig) -> ScoreCounts:
    """Score the samples without a reward against their prompt's label (metadata: prompt's, then sample's)."""
    pairs = [(g, s) for g in groups for s in g.samples if s.reward is None]
    return await score_async(
        [s for _, s in pairs], reward, [g.prompt.label for g, _ in pairs], [{**g.prompt.metadata, **s.metadata} for g, s in pairs],
        prompts=[g.prompt.prompt for g, _ in pairs],  # a judge (reward.model) reads them
    )


async def run_rollout(
    ctx: RolloutContext,
    prompts: Sequence[tuple[Prompt, list[int]]],
    first_group_id: int,
    n_samples: int,
    reward: RewardConfig,
) -> RolloutResult:
    """One rollout call through the plug-in layer the config names (rollout, generate or agent function)."""
    from noria.agent.plugins import agent_generate

    ctx = dataclasses.replace(ctx, prompts={}, session_server=None)  # callers may share one ctx across calls
    cfg = ctx.sampling
    rollout_fn, generate_fn, agent_fn = (getattr(cfg, k, "") for k in ("rollout_fn", "generate_fn", "agent_fn"))
    if rollout_fn:
        return await custom_rollout(ctx, load_plugin(rollout_fn, "rollout.rollout_fn"), prompts, first_group_id, reward)
    if generate_fn:
        generate = load_plugin(generate_fn, "rollout.generate_fn")
        return await rollout_groups(ctx, prompts, first_group_id, n_samples, reward, generate)
    if not agent_fn:
        return await rollout_groups(ctx, prompts, first_group_id, n_samples, reward)
    from noria.agent.session import SessionCounters, SessionLimits, SessionServer

    generate = agent_generate(load_plugin(agent_fn, "rollout.agent_fn"), getattr(cfg, "agent_timeout_s", 600.0))
    base = sampling_params(ctx, Sample(prompt_ids=[]))
    on_mismatch = getattr(cfg, "session_on_mismatch", "error")
    routes = getattr(cfg, "wants_routes", False)
    # One count per run: every call's server shares the context's counters (ctx.extra is shared by its copies).
    counters = ctx.extra.setdefault("session_counters", SessionCounters())
    limits = SessionLimits.from_rollout(cfg)
    renderer = ctx.processor or ctx.tokenizer  # a vision-language model's processor renders images in sessions
    async with SessionServer(ctx.engine, renderer, base, on_mismatch, limits, counters, routes=routes) as server:
        ctx.session_server = server
        return await rollout_groups(ctx, prompts, first_group_id, n_samples, reward, generate)


async def custom_rollout(
    ctx: RolloutContext, fn: Any, prompts: Sequence[tuple[Prompt, list[int]]], first_group_id: int, reward: RewardConfig
) -> RolloutResult:
    """A rollout function's groups, checked against its contract and scored where it left rewards out."""
    start = time.perf_counter()
    ctx.first_group_id = first_group_id
    ctx.prompts.update({first_group_id + g: prompt for g, (prompt, _) in enumerate(prompts)})
    groups = list(await fn(ctx, list(prompts)))
    check_groups(groups, first_group_id, len(prompts))
    reward_start = time.perf_counter()
    counts = await score_unscored(groups, reward)
    now = time.perf_counter()
    return RolloutResult(groups, counts, now - start, now - reward_start)


def check_groups(groups: Sequence[Group], first_group_id: int, n_prompts: int) -> None:
    """Raise ``PluginError`` naming the first broken rule of the rollout-function contract."""
    if len(groups) != n_prompts:
        raise PluginError(f"rollout function returned {len(groups)} groups for {n_prompts} prompts")
    for i, g in enumerate(groups):
        if not isinstance(g, Group) or g.group_id != first_group_id + i:
            raise PluginError(f"rollout function: group {i} must be a Group with group_id {first_group_id + i}")
        for s in g.samples:
            n = len(s.response_ids)
            if not (len(s.loss_mask) == len(s.rollout_logprobs) == len(s.weight_versions) == n):
                raise PluginError(
                    f"rollout function: group {g.group_id} sample {s.index} has {n} response ids but "
                    f"{len(s.loss_mask)} mask / {len(s.rollout_logprobs)} logprob / {len(s.weight_versions)} version entries"
                )


def granularity(rollout: Any) -> str:
    """``rollout.granularity`` resolved: auto is sample-level under asynchronous RL, group-level otherwise."""
    if rollout.granularity != "auto":
        return rollout.granularity
    return "sample" if rollout.max_staleness > 0 else "group"


def rollout_plugin(rollout: Any) -> dict[str, Any]:
    """How the scheduler produces a group: per trajectory with a generate function (the default, or
    ``rollout.generate_fn``), or a whole group at a time through a rollout or agent function."""
    if getattr(rollout, "rollout_fn", "") or getattr(rollout, "agent_fn", ""):
        return {"rollout_group": run_rollout}
    if getattr(rollout, "generate_fn", ""):
        return {"generate": load_plugin(rollout.generate_fn, "rollout.generate_fn")}
    return {"generate": generate_one}
