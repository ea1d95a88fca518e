"""Scoring samples: call the configured reward per sample, concurrently, with a timeout each.

What this module owns: writing ``Sample.reward``, or marking the sample ``Status.FAILED`` with a
``status_reason`` when its reward cannot be trusted. A reward that raises, runs past
``RewardConfig.timeout_s``, or returns something other than a finite real number (bools count as
0/1) leaves ``reward = None``: a failure is never turned into a silent 0. Samples that are already
failed or aborted are skipped. ``score_async`` returns ``ScoreCounts`` for the step's metrics.

Two forms of reward function, told apart by its signature (``noria.plugins.is_batched``): the
per-sample ``fn(response, label, metadata, **kwargs) -> float`` and TRL's batched
``fn(completions, **kwargs) -> list[float]`` (a parameter named ``completions``), called once per
batch with TRL's keyword lists (``score_batch``).

How it runs: at most ``max_concurrency`` reward calls are in flight; the timeout of a call starts
when it gets its slot. ``async def`` rewards run on the caller's event loop under
``asyncio.wait_for``. Plain functions run each in a fresh daemon thread (a pool bounded by the same
limit): a timed-out call cannot be interrupted, so it is abandoned, and a daemon thread holds
neither a slot nor the interpreter's exit, where ``ThreadPoolExecutor`` would do both.

Not guaranteed: an abandoned sync call keeps running (and holding a CPU) until it returns; an
``async`` reward that blocks without awaiting stalls the whole event loop and defeats the timeout,
so CPU-heavy rewards should be plain functions.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from noria.config import RewardConfig
from noria.plugins import PLUG_POINTS, is_batched
from noria.rewards.registry import RewardFn, get_reward
from noria.types import Group, Sample, Status

SKIPPED_STATUSES = (Status.FAILED, Status.ABORTED)
FAILURE_KINDS: tuple[str, ...] = ("raised", "timeout", "not_a_number", "non_finite")
"""Every kind of failure of a reward function (``reward/failed/<kind>``); a judge's (``reward.model``)
are ``noria.rewards.judge.JUDGE_FAILURE_KINDS`` on top."""


@dataclass
class ScoreCounts:
    """What one scoring call did, for metrics."""

    scored: int = 0
    """Samples that received a reward."""
    skipped: int = 0
    """Samples not scored because they had already failed or been aborted."""
    failed: Counter = field(default_factory=Counter)
    """Samples whose reward failed, by kind: ``raised``, ``timeout``, ``not_a_number``, ``non_finite``."""
    seconds: float = 0.0
    """Wall seconds of the scoring call (the rollout scheduler logs their sum as ``time/reward_s``)."""
    components: dict[str, list[float]] = field(default_factory=dict)
    """With ``reward.model``: each part's value per scored sample, by name (the rule's and the judge's)."""
    agreement: list[bool] = field(default_factory=list)
    """With ``reward.model`` and a rule: per sample scored by both, whether they agreed."""
    model_latencies: list[float] = field(default_factory=list)
    """Seconds of every answered judge request."""
    model_cache_hits: int = 0
    """Samples whose verdict came from the judge's cache."""
    hidden_seconds: float = 0.0
    """Of ``seconds``: scoring that ran while the group's other samples were still generating."""

    @property
    def n_failed(self) -> int:
        return sum(self.failed.values())

    def merge(self, other: ScoreCounts) -> None:
        """Add ``other``'s counts to these (the scheduler sums a step's scoring calls)."""
        self.scored += other.scored
        self.skipped += other.skipped
        self.seconds += other.seconds
        self.hidden_seconds += other.hidden_seconds
        self.failed.update(other.failed)
        for name, values in other.components.items():
            self.components.setdefault(name, []).extend(values)
        self.agreement += other.agreement
        self.model_latencies += other.model_latencies
        self.model_cache_hits += other.model_cache_hits

    def as_metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Flat metrics: ``reward/scored``, ``reward/skipped``, ``reward/failed``, ``reward/failed/<kind>``;
        with a model reward also ``reward/component/<name>`` (mean), ``reward/agreement``,
        ``reward/model_latency_s_p50`` / ``_p99`` and ``reward/model_cache_hits``."""
        metrics = {f"{prefix}scored": self.scored, f"{prefix}skipped": self.skipped, f"{prefix}failed": self.n_failed}
        metrics.update({f"{prefix}failed/{kind}": n for kind, n in sorted(self.failed.items())})
        metrics.update({f"{prefix}component/{name}": sum(v) / len(v) for name, v in sorted(self.components.items()) if v})
        if self.agreement:
            metrics[f"{prefix}agreement"] = sum(self.agreement) / len(self.agreement)
        if self.model_latencies:
            ordered = sorted(self.model_latencies)
            metrics[f"{prefix}model_latency_s_p50"] = ordered[(len(ordered) - 1) // 2]
            metrics[f"{prefix}model_latency_s_p99"] = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
        if self.components:
            metrics[f"{prefix}model_cache_hits"] = self.model_cache_hits
        return metrics


class RewardFailure(Exception):
    """A reward call did not produce a usable score; ``kind`` classifies it for metrics."""

    def __init__(self, kind: str, reason: str):
        if kind not in FAILURE_KINDS:
            raise ValueError(f"reward failure kind {kind!r} is not one of {FAILURE_KINDS}")
        super().__init__(reason)
        self.kind = kind


# ------------------------------------------------------------------------------------- public API


def scores_in_batches(reward_cfg: RewardConfig) -> bool:
    """Whether the rule reward is a batched (TRL-style) function, written to see many samples per call."""
    return reward_cfg.name is not None and is_batched(get_reward(reward_cfg.name), PLUG_POINTS["reward.name"])


async def score_async(
    samples: Sequence[Sample],
    reward_cfg: RewardConfig,
    labels: Sequence[Any],
    metadata: Sequence[dict[str, Any]] | None = None,
    *,
    max_concurrency: int | None = None,
    prompts: Sequence[Any] | None = None,
) -> ScoreCounts:
    """Score ``samples`` against ``labels`` (parallel lists); metadata defaults to each sample's own;
    ``prompts`` (text or chat messages, parallel too) reach a batched (TRL-style) reward as ``prompts``."""
    if len(labels) != len(samples) or (metadata is not None and len(metadata) != len(samples)):
        raise ValueError(f"score: {len(samples)} samples but {len(labels)} labels / metadata of another length")
    max_concurrency = reward_cfg.max_concurrency if max_concurrency is None else max_concurrency
    if max_concurrency < 1:
        raise ValueError(f"score: max_concurrency must be >= 1, got {max_concurrency}")
    with_model = reward_cfg.model.kind != "none"
    if reward_cfg.name is None and not with_model:
        raise ValueError("score: reward_cfg.name is None; resolve the task's default with resolve_reward() first")
    fn = get_reward(reward_cfg.name) if reward_cfg.name is not None else None
    counts = ScoreCounts()
    start = time.perf_counter()
    todo = [i for i, sample in enumerate(samples) if sample.status not in SKIPPED_STATUSES]
    counts.skipped = len(samples) - len(todo)
    metas = [dict(metadata[i] if metadata is not None else samples[i].metadata) for i in todo]
    if with_model:  # a judge, and the rule if named: noria.rewards.mixed
        from noria.rewards.mixed import score_mixed

        picked = [prompts[i] for i in todo] if prompts is not None else None
        kinds = await score_mixed(fn, reward_cfg, [samples[i] for i in todo], [labels[i] for i in todo], metas, picked, counts, max_concurrency)
    elif is_batched(fn, PLUG_POINTS["reward.name"]):  # TRL's form: one call for the whole batch
        rows = [(samples[i], labels[i], meta, prompts[i] if prompts is not None else None) for i, meta in zip(todo, metas)]
        kinds = await score_batch(fn, reward_cfg, rows)
    else:
        limit = asyncio.Semaphore(max_concurrency)
        kinds = await asyncio.gather(*(score_one(fn, reward_cfg, samples[i], labels[i], m, limit) for i, m in zip(todo, metas)))
    for kind in kinds:
        if kind is None:
            counts.scored += 1
        else:
            counts.failed[kind] += 1
    counts.seconds = time.perf_counter() - start
    return counts


def score(
    samples: Sequence[Sample],
    reward_cfg: RewardConfig,
    labels: Sequence[Any],
    metadata: Sequence[dict[str, Any]] | None = None,
    *,
    max_concurrency: int | None = None,
    prompts: Sequence[Any] | None = None,
) -> ScoreCounts:
    """``score_async`` from synchronous code (not from inside a running event loop)."""
    _refuse_running_loop("score")
    return asyncio.run(score_async(samples, reward_cfg, labels, metadata, max_concurrency=max_concurrency, prompts=prompts))


async def score_groups_async(
    groups: Sequence[Group], reward_cfg: RewardConfig, *, max_concurrency: int | None = None
) -> ScoreCounts:
    """Score every sample of ``groups`` against its prompt's label; metadata = prompt's, then sample's."""
    samples = [s for g in groups for s in g.samples]
    labels = [g.prompt.label for g in groups for _ in g.samples]
    metadata = [{**g.prompt.metadata, **s.metadata} for g in groups for s in g.samples]
    prompts = [g.prompt.prompt for g in groups for _ in g.samples]
    return await score_async(samples, reward_cfg, labels, metadata, max_concurrency=max_concurrency, prompts=prompts)


def score_groups(groups: Sequence[Group], reward_cfg: RewardConfig, *, max_concurrency: int | None = None) -> ScoreCounts:
    """``score_groups_async`` from synchronous code."""
    _refuse_running_loop("score_groups")
    return asyncio.run(score_groups_async(groups, reward_cfg, max_concurrency=max_concurrency))


def _refuse_running_loop(name: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"{name}() was called inside a running event loop; await {name}_async() instead")


# ----------------------------------------------------------------------------------- one sample


async def score_one(
    fn: RewardFn, cfg: RewardConfig, sample: Sample, label: Any, metadata: dict[str, Any], limit: asyncio.Semaphore
) -> str | None:
    """Score one sample in place; return the failure kind, or None on success."""
    async with limit:
        try:
            scored = sample.response_text if sample.image is None else sample.image  # image samples: the image
            value = await _call_with_timeout(fn, cfg, scored, label, metadata)
            sample.reward = check_reward_value(value, cfg.name)
        except RewardFailure as failure:
            sample.reward, sample.status, sample.status_reason = None, Status.FAILED, str(failure)
            return failure.kind
    return None


async def _call_with_timeout(fn: RewardFn, cfg: RewardConfig, response: str, label: Any, metadata: dict) -> Any:
    try:
        return await asyncio.wait_for(_call(fn, cfg, response, label, metadata), cfg.timeout_s)
    except asyncio.TimeoutError as e:  # only wait_for's own: _call turns the reward's errors into RewardFailure
        raise RewardFailure("timeout", f"reward {cfg.name!r} timed out after {cfg.timeout_s} s") from e


async def _call(fn: RewardFn, cfg: RewardConfig, response: str, label: Any, metadata: dict) -> Any:
    try:
        if inspect.iscoroutinefunction(fn):
            return await fn(response, label, metadata, **cfg.kwargs)
        result = await _in_daemon_thread(fn, response, label, metadata, **cfg.kwargs)
        if inspect.isawaitable(result):  # e.g. a callable object whose __call__ is async
            result = await result
        return result
    except Exception as e:  # classify: any error inside a reward fails that sample only
        raise RewardFailure("raised", f"reward {cfg.name!r} raised {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------- a batch (TRL's form)


async def score_batch(fn: RewardFn, cfg: RewardConfig, rows: list[tuple[Sample, Any, dict, Any]]) -> list[str | None]:
    """Score ``(sample, label, metadata, prompt)`` rows with one call of a batched reward, as TRL's
    GRPOTrainer calls it: ``fn(prompts=, completions=, completion_ids=, label=, <metadata key>=, **kwargs)``,
    every argument a list with one item per row. A call that fails, or a list of the wrong length, fails
    every row; a value that is not a finite number (TRL's ``None`` included) fails its row only."""
    if not rows:
        return []
    columns = batch_arguments(rows)
    try:
        values = await asyncio.wait_for(_call_batch(fn, cfg, columns), cfg.timeout_s)
        if not isinstance(values, (list, tuple)) or len(values) != len(rows):
            shown = f"a list of {len(values)}" if isinstance(values, (list, tuple)) else type(values).__name__
            raise RewardFailure("not_a_number", f"reward {cfg.name!r} returned {shown} for {len(rows)} completions")
    except asyncio.TimeoutError:
        return [_fail(s, RewardFailure("timeout", f"reward {cfg.name!r} timed out after {cfg.timeout_s} s")) for s, *_ in rows]
    except RewardFailure as failure:
        return [_fail(s, failure) for s, *_ in rows]
    kinds = []
    for (sample, *_), value in zip(rows, values):
        try:
            sample.reward = check_reward_value(value, cfg.name)
            kinds.append(None)
        except RewardFailure as failure:
            kinds.append(_fail(sample, failure))
    return kinds


def batch_arguments(rows: list[tuple[Sample, Any, dict, Any]]) -> dict[str, list[Any]]:
    """TRL's keyword lists: a chat prompt (a list of messages) gets its completion as one assistant
    message, as TRL's conversational format has it; a text prompt gets the completion's text. The
    dataset's columns: ``label`` and every metadata key (``data.metadata_keys``: list ``solution`` there
    for a reward that reads ``solution``)."""
    chat = [isinstance(prompt, (list, tuple)) for _, _, _, prompt in rows]
    columns: dict[str, list[Any]] = {
        "prompts": [list(p) if c else p for (_, _, _, p), c in zip(rows, chat)],
        "completions": [
            [{"role": "assistant", "content": s.response_text}] if c else s.response_text for (s, *_), c in zip(rows, chat)
        ],
        "completion_ids": [list(s.response_ids) for s, *_ in rows],
        "label": [label for _, label, _, _ in rows],
    }
    for key in dict.fromkeys(k for _, _, meta, _ in rows for k in meta):
        if key not in columns:
            columns[key] = [meta.get(key) for _, _, meta, _ in rows]
    return columns


async def _call_batch(fn: RewardFn, cfg: RewardConfig, columns: dict[str, list[Any]]) -> Any:
    try:
        if inspect.iscoroutinefunction(fn):
            return await fn(**columns, **cfg.kwargs)
        result = await _in_daemon_thread(fn, **columns, **cfg.kwargs)
        return await result if inspect.isawaitable(result) else result
    except Exception as e:  # classify: the call failed, so every row of the batch fails
        raise RewardFailure("raised", f"reward {cfg.name!r} raised {type(e).__name__}: {e}") from e


def _fail(sample: Sample, failure: RewardFailure) -> str:
    sample.reward, sample.status, sample.status_reason = None, Status.FAILED, str(failure)
    return failure.kind


def check_reward_value(value: Any, name: str) -> float:
    """``value`` as a float if it is a finite real number (or a bool); ``RewardFailure`` otherwise."""
    if not isinstance(value, numbers.Real):
        shown = f"{type(value).__name__} {value!r:.80}"
        raise RewardFailure("not_a_number", f"reward {name!r} returned {shown}, not a number")
    result = float(value)
    if not math.isfinite(result):
        raise RewardFailure("non_finite", f"reward {name!r} returned {result}, not a finite number")
    return result


# --------------------------------------------------------------------------------------- threads


def _in_daemon_thread(fn: RewardFn, *args: Any, **kwargs: Any) -> asyncio.Future:
    """Run ``fn`` in a new daemon thread; the returned future resolves on the caller's loop."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            outcome = (True, fn(*args, **kwargs))
        except BaseException as e:  # handed to the awaiting coroutine, which classifies it
            outcome = (False, e)
        _deliver(loop, future, outcome)

    threading.Thread(target=run, name="noria-reward", daemon=True).start()
    return future


def _deliver(loop: asyncio.AbstractEventLoop, future: asyncio.Future, outcome: tuple[bool, Any]) -> None:
    def settle() -> None:
        if future.done():  # timed out and cancelled: nobody waits for this result any more
            return
        ok, value = outcome
        future.set_result(value) if ok else future.set_exception(value)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop has closed since the call was abandoned; drop the late result
        pass
