"""Rewards served by a model (``reward.model``): the generative judge's and the scalar reward model's
scorer, its endpoint, its cache, and the engine a run starts for it.

What this module owns: ``ModelReward`` (scores rows of (prompt, response, label, metadata) with one
judge: every request of a call sent at once, at most ``max_concurrency`` in flight, so the judge
engine batches them; a rubric as one request per criterion or one for all, weighted), the scorer
cache (within a run, keyed by a hash of (judge version, prompt, response); the judge version is a
hash of everything that changes a verdict: server or model, template, parser, rubric, sampling),
and the scorers in use by judge name (``bind_judge`` for a judge the run started, else built from
``reward.model.url`` on first use). ``start_judge_engine`` serves ``reward.model.engine`` with
``noria serve`` (``noria.engine.child``: the run's ``engine.*`` keys, weight version 0, never synced).
A scalar reward model (``kind: scalar``, ``noria.rewards.scalar``) goes through the same scorer, one
``/classify`` request per row, or is loaded in this process (``in_process``); ``engine: shared``
sends the judge's requests to the run's rollout engines (``noria.rewards.shared``).

Failure: a row whose judge request fails or whose verdict does not parse comes back as a
``JudgeFailure`` (the runner marks its sample failed, counted by kind); nothing here raises for one
row. A judge the run needs but that was never started (``reward.model.engine`` outside ``noria
train``) is a ``NoriaError`` naming the key.

Not guaranteed: the cache holds at most ``CACHE_ROWS`` verdicts (oldest dropped first); a judge
behind ``reward.model.url`` that changes its weights mid-run keeps its cached verdicts.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from noria.config.reward import RewardModelConfig
from noria.errors import NoriaError
from noria.rewards.judge import JudgeClient, JudgeFailure, parse_verdict, parse_verdicts, render_messages

CACHE_ROWS = 100_000
"""Verdicts a scorer keeps (about 100 bytes each)."""


@dataclass
class Row:
    """What the judge sees of one sample."""

    prompt: Any
    response: str
    label: Any
    metadata: dict[str, Any]


@dataclass
class Scored:
    """What one scoring call of ``ModelReward`` gave: a value or a ``JudgeFailure`` per row, the
    seconds of every answered request, and how many rows came from the cache."""

    values: list[float | JudgeFailure]
    latencies: list[float] = field(default_factory=list)
    cache_hits: int = 0


class ModelReward:
    """One judge's scorer (``reward.model.kind: judge``)."""

    def __init__(self, cfg: RewardModelConfig, client: JudgeClient) -> None:
        self.cfg = cfg
        self.client = client
        if cfg.kind == "scalar":  # one classify request per row instead of a verdict (noria.rewards.scalar)
            from noria.rewards.scalar import scalar_score_fn

            self._judge = scalar_score_fn(cfg, client)  # type: ignore[method-assign]
        self.version = judge_version(cfg, client.url)
        self.cache: OrderedDict[str, float] = OrderedDict()
        self.asking: dict[str, asyncio.Future] = {}
        """Rows being asked now, by cache key: a duplicate waits for that answer instead of asking again."""

    async def score(self, rows: Sequence[Row]) -> Scored:
        """Every row's judge reward in [0, 1], or the ``JudgeFailure`` that stopped it."""
        out = Scored(values=[])
        limit = asyncio.Semaphore(self.cfg.max_concurrency)
        async with self.client.http() as http:
            out.values = list(await asyncio.gather(*(self._score_row(http, row, limit, out) for row in rows)))
        return out

    async def _score_row(self, http: Any, row: Row, limit: asyncio.Semaphore, out: Scored) -> float | JudgeFailure:
        key = self.cache_key(row)
        if self.cfg.cache and key in self.cache:
            out.cache_hits += 1
            self.cache.move_to_end(key)
            return self.cache[key]
        if self.cfg.cache and key in self.asking:  # the same row asked a moment ago: share its answer
            out.cache_hits += 1
            return await asyncio.shield(self.asking[key])
        asked = asyncio.ensure_future(self._verdict(http, row, limit, out))
        if self.cfg.cache:
            self.asking[key] = asked
        try:
            value = await asyncio.shield(asked)
        finally:
            self.asking.pop(key, None)
        if self.cfg.cache and not isinstance(value, JudgeFailure):
            self.cache[key] = value
            while len(self.cache) > CACHE_ROWS:
                self.cache.popitem(last=False)
        return value

    async def _verdict(self, http: Any, row: Row, limit: asyncio.Semaphore, out: Scored) -> float | JudgeFailure:
        try:
            return await self._judge(http, row, limit, out)
        except JudgeFailure as failure:
            return failure
        except Exception as e:  # classify: never raise from a shielded task, which may outlive its caller
            # (a scoring call cancelled as the run stops closes the client under it): a failed sample
            return JudgeFailure("raised", f"{self.client.name}: {type(e).__name__}: {e}")

    async def _judge(self, http: Any, row: Row, limit: asyncio.Semaphore, out: Scored) -> float:
        cfg = self.cfg

        async def ask(criterion: str) -> str:
            messages = render_messages(cfg, row.prompt, row.response, row.label, row.metadata, criterion)
            async with limit:
                text, seconds = await self.client.ask(http, messages)
            out.latencies.append(seconds)
            return text

        if not cfg.rubric:
            return parse_verdict(cfg, await ask(""), row.label)
        weights = [float(item.get("weight", 1.0)) for item in cfg.rubric]
        criteria = [str(item["criterion"]) for item in cfg.rubric]
        if cfg.rubric_mode == "all":
            listed = "\n".join(f"{i + 1}. {c}" for i, c in enumerate(criteria))
            scores = parse_verdicts(cfg, await ask(listed), len(criteria), row.label)
        else:
            texts = await asyncio.gather(*(ask(c) for c in criteria))
            scores = [parse_verdict(cfg, t, row.label) for t in texts]
        return sum(w * s for w, s in zip(weights, scores)) / sum(weights)

    def cache_key(self, row: Row) -> str:
        """The hash of (judge version, prompt, response, label, metadata): the template may read all four."""
        data = json.dumps([self.version, row.prompt, row.response, row.label, row.metadata], sort_keys=True, default=str)
        return hashlib.sha256(data.encode()).hexdigest()


def judge_version(cfg: RewardModelConfig, url: str) -> str:
    """A hash of what changes a verdict: the server (or served model), the prompt, the parser, the sampling."""
    fields = asdict(cfg)
    for volatile in ("timeout_s", "retries", "max_concurrency", "cache", "agreement_threshold", "weight", "api_key_env", "priority", "in_process"):
        fields.pop(volatile)
    fields["url"] = cfg.engine or url  # a judge the run starts is its model, wherever it listens
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------- scorers in use

_SCORERS: dict[str, ModelReward] = {}


def bind_judge(cfg: RewardModelConfig, url: str, api_key: str | None, tokenizer: Any = None) -> ModelReward:
    """Use the judge server (or scalar reward model server) at ``url`` for ``cfg.name`` from now on."""
    if cfg.kind == "scalar":
        from noria.rewards.scalar import ClassifyClient

        return bind_client(cfg, ClassifyClient(cfg, url, api_key, tokenizer))
    return bind_client(cfg, JudgeClient(cfg, url, api_key, tokenizer))


def bind_client(cfg: RewardModelConfig, client: JudgeClient) -> ModelReward:
    """Score ``cfg.name`` through ``client`` from now on (a server, the rollout engines, this process)."""
    scorer = ModelReward(cfg, client)
    _SCORERS[cfg.name] = scorer
    return scorer


def unbind_judge(name: str) -> None:
    """Forget the scorer of ``name`` (its server stopped): a later use builds it again from its config."""
    _SCORERS.pop(name, None)


def model_reward(cfg: RewardModelConfig) -> ModelReward:
    """The scorer of ``cfg``: the one bound or built before for its name and version, else one built
    from ``reward.model.url`` (its API key from the environment variable ``api_key_env``)."""
    scorer = _SCORERS.get(cfg.name)
    if scorer is not None and scorer.cfg == cfg:
        return scorer
    if scorer is not None and cfg.engine is not None and _same_but_url(scorer.cfg, cfg):
        return scorer  # the run's own judge engine, bound with its address
    if cfg.url is None:
        raise NoriaError(
            f"reward.model.engine {cfg.engine!r}: the judge {cfg.name!r} is served by a `noria serve` that noria train starts; "
            "from code, start it with noria.rewards.model.start_judge_engine or give reward.model.url"
        )
    key = api_key_from_env(cfg)
    tokenizer = judge_tokenizer(cfg, cfg.url, key) if cfg.api == "sglang" or cfg.kind == "scalar" else None
    return bind_judge(cfg, cfg.url, key, tokenizer)


def _same_but_url(a: RewardModelConfig, b: RewardModelConfig) -> bool:
    return {**asdict(a), "url": None} == {**asdict(b), "url": None}


def api_key_from_env(cfg: RewardModelConfig) -> str | None:
    """The judge's API key from the environment variable ``reward.model.api_key_env`` names."""
    if not cfg.api_key_env:
        return None
    key = os.environ.get(cfg.api_key_env)
    if not key:
        raise NoriaError(f"reward.model.api_key_env: the environment variable {cfg.api_key_env} is not set (the judge's API key)")
    return key


def judge_tokenizer(cfg: RewardModelConfig, url: str, api_key: str | None) -> Any:
    """api sglang: the tokenizer whose chat template renders the judge's prompt: ``reward.model.tokenizer``,
    the ``engine`` model, else the one the server at ``url`` reports."""
    from noria.models import load_tokenizer
    from noria.models.catalog import model_path

    name = cfg.tokenizer or cfg.engine
    if name is None:
        from noria.distill.teacher import teacher_tokenizer

        return teacher_tokenizer(url, api_key)[0]
    tokenizer = load_tokenizer(model_path(name))
    if not getattr(tokenizer, "chat_template", None) and cfg.kind != "scalar":  # a reward model reads prompt + response as text
        raise NoriaError(f"reward.model: the judge's tokenizer {name} has no chat template; set reward.model.tokenizer or api: openai")
    return tokenizer


def start_judge_engine(config: Any, folder: Path) -> tuple[Any, ModelReward]:
    """``noria serve`` of ``reward.model.engine`` (``noria.engine.child``: on ``reward.model.engine_device``,
    else ``model.device``, on ``reward.model.engine_threads``; logging to ``folder/judge.log``), bound as
    the run's judge: (child, scorer)."""
    from noria.engine.child import engine_device, start_engine_server
    from noria.models.catalog import model_path

    cfg = config.reward.model
    path = model_path(cfg.engine)
    device = cfg.engine_device or engine_device(config)
    child, url, key = start_engine_server(path, config, folder, device, "judge.log", threads=cfg.engine_threads,
                                          passive_wait=device.startswith("cpu"))  # it shares the cores with the policy's engine
    try:
        scorer = bind_judge(cfg, url, key, judge_tokenizer(cfg, url, key) if cfg.api == "sglang" or cfg.kind == "scalar" else None)
    except BaseException:
        child.stop()
        raise
    return child, scorer


def start_judge(config: Any, folder: Path, rollout: Any = None, tokenizer: Any = None) -> list[Any]:
    """At a run's start: forget the judge scorers of earlier runs in this process (the cache is a
    run's), and start the judge engine of ``reward.model.engine`` if any; the children to stop.
    ``engine: shared`` binds the judge to ``rollout`` (the run's engine client, the policy's
    ``tokenizer``); a scalar reward model ``in_process`` is loaded here."""
    cfg = config.reward.model
    unbind_judge(cfg.name)
    if cfg.kind == "none" or cfg.engine is None:
        return []
    if cfg.engine == "shared":
        if rollout is None or tokenizer is None:
            raise NoriaError("reward.model.engine shared: the judge needs the run's rollout engines (start it from noria train)")
        from noria.rewards.shared import SharedJudgeClient

        bind_client(cfg, SharedJudgeClient(cfg, rollout, tokenizer))
        return []
    from noria.console import phase

    if cfg.in_process:
        with phase(f"loading the reward model {cfg.name!r} ({cfg.engine}) in this process"):
            start_local_reward_model(config)
        return []
    with phase(f"starting the judge engine {cfg.name!r} with {cfg.engine}"):
        return [start_judge_engine(config, folder)[0]]


def start_local_reward_model(config: Any) -> ModelReward:
    """``reward.model.in_process``: the scalar reward model loaded here (on ``engine_device``, else
    ``model.device``), bound as the run's scorer."""
    from noria.engine.server.classifier import SequenceClassifier
    from noria.models.catalog import model_path
    from noria.rewards.scalar import LocalClassifyClient

    cfg = config.reward.model
    classifier = SequenceClassifier.from_path(model_path(cfg.engine), config.model.dtype, cfg.engine_device or config.model.device)
    if classifier.tokenizer is None:
        raise NoriaError(f"reward.model.engine {cfg.engine}: the reward model's folder has no tokenizer")
    return bind_client(cfg, LocalClassifyClient(cfg, classifier, judge_tokenizer(cfg, "", None)))
