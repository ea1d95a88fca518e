"""Mixed rewards: the rule reward (``reward.name``) and a model reward (``reward.model``), weighted.

What this module owns: ``score_mixed``, which scores samples with both at once (the rule through the
runner's own per-sample or batched path, on copies of the samples; the judge through
``noria.rewards.model``), then writes ``sample.reward = rule_weight * rule + weight * judge`` and
``sample.metadata["rewards"] = {name: value}`` (each part under its own name), and counts each part
(``reward/component/<name>``), their agreement (``reward/agreement``: both at or above
``reward.model.agreement_threshold``, or both below it) and the judge's request latencies.

Failure: a part with a non-zero weight that fails fails the sample (its kind counted as the
runner's failures); a part with weight 0 (measured only) that fails is left out of the sample's
``rewards`` and of the agreement, and the sample keeps the other part's reward.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

from noria.config import RewardConfig
from noria.rewards.judge import JudgeFailure
from noria.rewards.model import Row, model_reward
from noria.types import Sample, Status


async def score_mixed(
    fn: Any, cfg: RewardConfig, samples: Sequence[Sample], labels: Sequence[Any], metas: Sequence[dict[str, Any]],
    prompts: Sequence[Any] | None, counts: Any, max_concurrency: int,
) -> list[str | None]:
    """Score ``samples`` (none skipped) with the rule ``fn`` (None: no rule) and the judge; return each
    sample's failure kind or None, and add the parts' figures to ``counts`` (a ``ScoreCounts``)."""
    if prompts is None:
        raise ValueError(f"score: the judge {cfg.model.name!r} needs each sample's prompt (prompts=)")
    scorer = model_reward(cfg.model)
    rows = [Row(prompts[i], s.response_text, labels[i], metas[i]) for i, s in enumerate(samples)]
    shadows = [dataclasses.replace(s, metadata=dict(s.metadata)) for s in samples]
    rule = _rule_kinds(fn, cfg, shadows, labels, metas, prompts, max_concurrency) if fn is not None else _none(len(samples))
    rule_kinds, judged = await asyncio.gather(rule, scorer.score(rows))
    counts.model_latencies.extend(judged.latencies)
    counts.model_cache_hits += judged.cache_hits
    rule_name, judge_name = cfg.name or "rule", cfg.model.name
    kinds: list[str | None] = []
    for sample, shadow, rule_kind, verdict in zip(samples, shadows, rule_kinds, judged.values):
        parts: dict[str, float] = {}
        failure: tuple[str, str] | None = None
        if fn is not None:
            if rule_kind is None:
                parts[rule_name] = float(shadow.reward)
            elif cfg.rule_weight != 0:
                failure = (rule_kind, shadow.status_reason)
        if isinstance(verdict, JudgeFailure):
            if cfg.model.weight != 0 and failure is None:
                failure = (verdict.kind, str(verdict))
        else:
            parts[judge_name] = verdict
        if failure is not None:
            sample.reward, sample.status, sample.status_reason = None, Status.FAILED, failure[1]
            kinds.append(failure[0])
            continue
        weights = {rule_name: cfg.rule_weight, judge_name: cfg.model.weight}
        sample.reward = sum(weights[name] * value for name, value in parts.items())
        sample.metadata["rewards"] = parts
        kinds.append(None)
        _count_parts(counts, parts, rule_name, judge_name, cfg.model.agreement_threshold)
    return kinds


def _count_parts(counts: Any, parts: dict[str, float], rule: str, judge: str, threshold: float) -> None:
    for name, value in parts.items():
        counts.components.setdefault(name, []).append(value)
    if rule in parts and judge in parts:
        counts.agreement.append((parts[rule] >= threshold) == (parts[judge] >= threshold))


async def _rule_kinds(fn, cfg, shadows, labels, metas, prompts, max_concurrency) -> list[str | None]:
    from noria.plugins import PLUG_POINTS, is_batched
    from noria.rewards.runner import score_batch, score_one

    if is_batched(fn, PLUG_POINTS["reward.name"]):
        rows = [(s, labels[i], metas[i], prompts[i] if prompts is not None else None) for i, s in enumerate(shadows)]
        return await score_batch(fn, cfg, rows)
    limit = asyncio.Semaphore(max_concurrency)
    return list(await asyncio.gather(*(score_one(fn, cfg, s, labels[i], dict(metas[i]), limit) for i, s in enumerate(shadows))))


async def _none(n: int) -> list[str | None]:
    return [None] * n
