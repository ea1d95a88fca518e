"""``eval.mode: checkpoint``: an external backend evaluates a step's exported HF folder while training goes on.

The plug point (``eval.backend``, an import path ``pkg.module:Class``; contract in ``noria.plugins``
and ``tests/test_plugin_contracts.py``)::

    class MyBackend:
        def __init__(self, config: RunConfig): ...                       # once, before any model loads
        def evaluate(self, request: CheckpointRequest) -> list[list[str]]:  # in a worker thread
            # request.folder: a committed HF folder (config.json, safetensors, tokenizer files)
            # return request.n_samples answer texts for each of request.prompts, in order

Noria scores the answers with the run's reward (so every ``eval.mode`` computes accuracy the same
way) and writes the row; an exception, or answers of the wrong shape, make the evaluation skipped
with the reason (``noria.eval.modes``), never a failed run. The shipped backend is
``noria.eval.vllm_backend:VllmCheckpointBackend`` (vLLM's OpenAI server on the folder).

What blocks on what: ``evaluate`` runs in a daemon thread of its own; several may run at once (up
to ``eval.max_in_flight``), so a backend must not share mutable state between calls without a lock.
When the run stops (Ctrl-C, an error) a call in progress is abandoned, not awaited: a backend that
starts processes should make them die with this one (``noria.engine.vllm_server`` does).

Not guaranteed: that the backend generated with the weights of the folder it was given (Noria
cannot see inside it; the row records the step of the folder it handed over).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noria.errors import NoriaError
from noria.eval.modes import EvalHost, Outcome
from noria.types import Group, Prompt, Sample, Status


@dataclass(frozen=True)
class CheckpointRequest:
    """One evaluation for a checkpoint backend."""

    folder: Path
    """The committed HF folder of the step's weights."""
    step: int
    """The training step whose weights the folder holds."""
    run_dir: Path
    """The run's folder (a backend may write its logs there)."""
    prompts: list[tuple[Prompt, list[int]]]
    """The held-out prompts with their rendered token ids (chat template applied, as the rollout sees them)."""
    n_samples: int
    """Answers wanted per prompt (``eval.n_samples``)."""
    max_new_tokens: int
    temperature: float
    """0 is greedy."""
    top_p: float
    seed: int
    stop: list[str]
    """Stop strings of the rollout (``rollout.stop``)."""


class BackendAnswerError(NoriaError):
    """A checkpoint backend returned answers of the wrong shape."""


class CheckpointEval:
    """Runs ``eval.backend`` on snapshots (module docstring)."""

    def __init__(self, job: EvalHost) -> None:
        from noria.plugins import load_plugin

        self.job = job
        cls = load_plugin(job.config.eval.backend, "eval.backend")
        self.backend = cls(config=job.config)

    async def evaluate(self, snapshot: Path, step: int, version: int) -> Outcome:
        from noria.rollout.generate import score_unscored

        request = self.request(snapshot, step)
        answers = await in_daemon_thread(self.backend.evaluate, request)
        groups = answer_groups(request, answers, self.job.tokenizer)
        await score_unscored(groups, self.job.reward)
        return Outcome([s for g in groups for s in g.samples])

    def request(self, snapshot: Path, step: int) -> CheckpointRequest:
        e, r = self.job.config.eval, self.job.config.rollout
        return CheckpointRequest(snapshot, step, self.job.folder, list(self.job.test_prompts), e.n_samples, e.max_new_tokens, e.temperature,
                                 e.top_p, e.seed, list(r.stop))  # fmt: skip

    def close(self) -> None:
        pass  # the backend owns nothing between calls that Noria could stop


def in_daemon_thread(fn: Any, *args: Any) -> asyncio.Future:
    """``fn(*args)`` in a daemon thread, as an awaitable. Not ``asyncio.to_thread``: the loop's default
    executor is joined when ``asyncio.run`` ends, so Ctrl-C would wait for a backend's whole call (a
    vLLM start is a minute); a daemon thread is abandoned at exit instead."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():  # cancelled meanwhile: nobody waits for it
            future.set_exception(error) if error is not None else future.set_result(result)

    def work() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # handed to the awaiting task, which classifies it
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop is closed: the run ended meanwhile
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=work, name=f"noria eval backend {getattr(fn, '__qualname__', fn)}", daemon=True).start()
    return future


def answer_groups(request: CheckpointRequest, answers: Any, tokenizer: Any) -> list[Group]:
    """Unscored groups of the backend's answers; ``BackendAnswerError`` naming what is wrong with their shape."""
    n, k = len(request.prompts), request.n_samples
    if not isinstance(answers, list) or len(answers) != n:
        got = f"{len(answers)} items" if isinstance(answers, list) else type(answers).__name__
        raise BackendAnswerError(f"eval.backend returned {got}; expected a list of {n} (one per prompt)")
    groups = []
    for g, ((prompt, ids), texts) in enumerate(zip(request.prompts, answers)):
        if not isinstance(texts, list) or len(texts) != k or not all(isinstance(t, str) for t in texts):
            raise BackendAnswerError(f"eval.backend: prompt {g}: expected a list of {k} strings, got {texts!r:.200}")
        samples = tuple(answer_sample(ids, g, i, text, prompt, tokenizer) for i, text in enumerate(texts))
        groups.append(Group(group_id=g, prompt=prompt, samples=samples))
    return groups


def answer_sample(ids: list[int], group: int, index: int, text: str, prompt: Prompt, tokenizer: Any) -> Sample:
    response = tokenizer.encode(text, add_special_tokens=False)
    return Sample(prompt_ids=list(ids), response_ids=response, loss_mask=[0] * len(response), response_text=text,
                  group_id=group, index=index, status=Status.COMPLETED, metadata=dict(prompt.metadata))  # fmt: skip
