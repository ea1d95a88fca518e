"""In-flight work across a checkpoint: the requests still generating are recorded with their tokens,
and a resumed run continues them (``rollout.resume_in_flight``).

What this module owns: ``LiveRequests``, the gate the default generate function sends every engine
request through, so a checkpoint can stop them all where they are with their tokens; the policy
(``in_flight_policy``: continue or retract, and why); and the resume decision per recorded group
(``retract_reason``). The scheduler (``noria.rollout.scheduler``) records and restarts the groups;
the job (``noria.launch.job``) calls it around a checkpoint and at resume.

How a checkpoint records (policy ``continue``)::

    gate closed (no request starts) ─▶ every live request aborted: its answer holds the tokens so far
    (logprobs and weight versions too), appended to its sample ─▶ the sample waits at the gate
    ─▶ once every unfinished trajectory waits and no group is being scored: the record is taken in
    the same event-loop turn as the buffer and the data cursor, and written with the weights
    ─▶ gate opened: each waiting sample continues from its tokens (a new request whose input is the
    prompt and those tokens, re-prefilled; the tokens already sampled keep their logprobs and versions)

A resumed run restarts each recorded group under its id: samples that had finished stay, the others
continue from their recorded tokens the same way. A group whose oldest token is already staler than
``rollout.max_staleness`` at the checkpoint's weights could never be trained: it is retracted (its
prompt goes back to the data source) and the reason logged. Policy ``retract`` (and ``auto`` under
synchronous RL, where it keeps a resumed run bitwise equal to an uninterrupted one) keeps today's
behaviour: the prompts of groups in flight go back to the data source, their tokens are dropped.

What blocks on what: ``interrupt`` waits until no request is live (aborts are sent again every half
second: one may reach the engine before the request it aborts; that request then runs to its end).
A generate function of its own (``rollout.generate_fn``) that does not call ``LiveRequests`` is not
interrupted: the checkpoint waits until its trajectory ends.

Not guaranteed: the tokens sampled after an interruption are those of an uninterrupted request
(the continuation draws from a seed of its own, and is re-prefilled); a stop string spanning the
seam is found by the client (``seam_stop``), not by the engine.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from noria.config.rollout import resume_in_flight_blockers
from noria.engine.protocol import GenerateOutput, GenerateRequest
from noria.errors import NoriaError
from noria.rollout.buffer import group_from_dict
from noria.types import Group, Prompt, Status

def in_flight_policy(rollout: Any, client: Any = None) -> tuple[str, str]:
    """(``continue`` or ``retract``, why it is retract) for ``rollout.resume_in_flight``, with the engine
    ``client`` the scheduler uses when given: one without ``abort(rid)`` (an engine fleet's) cannot
    stop a request with its tokens. ``NoriaError`` when ``continue`` is asked for and cannot work."""
    want = rollout.resume_in_flight
    if want == "retract":
        return "retract", "rollout.resume_in_flight: retract"
    if want == "auto" and rollout.max_staleness == 0:
        return "retract", "synchronous RL (rollout.max_staleness 0) regenerates them, so a resumed run repeats an uninterrupted one"
    blockers = resume_in_flight_blockers(rollout)
    if client is not None and not callable(getattr(client, "abort", None)):
        blockers.append(f"its engine client ({type(client).__name__}) cannot stop one request with its tokens")
    if blockers and want == "continue":  # the config's own blockers were refused at load already
        raise NoriaError(f"rollout.resume_in_flight: continue cannot work here: {blockers[0]}; use auto or retract")
    return ("retract", blockers[0]) if blockers else ("continue", "")


def retract_reason(group: Group, version: int, max_staleness: int) -> str | None:
    """Why a recorded group is retracted at resume instead of continued (None: continue it): its
    oldest policy token is already staler than ``max_staleness`` at the checkpoint's ``version``,
    so the buffer would drop it whatever the continuation samples."""
    oldest = group.min_version
    if oldest is not None and version - oldest > max_staleness:
        return (f"stale: its oldest token is of weight version {oldest}, the checkpoint's is {version}, "
                f"rollout.max_staleness is {max_staleness}")  # fmt: skip
    return None


class LiveRequests:
    """The engine requests of the default generate function, and the gate a checkpoint closes.

    ``generate`` passes the gate (waiting while it is closed), then sends the request; ``interrupt``
    closes the gate and aborts every live request; ``stopped(out)`` tells a generate function that
    an answer is such an abort (the tokens so far are to be kept, then continued after ``release``).
    ``parked`` counts the trajectories waiting at the closed gate. One asyncio event loop."""

    def __init__(self) -> None:
        self.requests: set[str] = set()
        self.parked = 0
        self.changed: Callable[[], None] = lambda: None
        """Called when a request ends or a trajectory parks (the scheduler wakes its recorder)."""
        self._open: asyncio.Event | None = None

    @property
    def closed(self) -> bool:
        return self._open is not None and not self._open.is_set()

    async def gate(self) -> None:
        """Return at once while open; while a checkpoint records, wait (counted in ``parked``)."""
        if not self.closed:
            return
        self.parked += 1
        self.changed()
        try:
            await self._open.wait()
        finally:
            self.parked -= 1

    async def generate(self, engine: Any, req: GenerateRequest) -> GenerateOutput:
        await self.gate()
        self.requests.add(req.rid)  # no await since the gate: an interrupt sees this request
        try:
            return await engine.generate(req)
        finally:
            self.requests.discard(req.rid)
            self.changed()

    def stopped(self, out: GenerateOutput) -> bool:
        """``out`` is an abort while a checkpoint records: keep its tokens and continue after ``release``."""
        return self.closed and (out.finish_reason or {}).get("type") == "abort"

    async def interrupt(self, engine: Any, wait: Callable[[float], Awaitable[None]]) -> None:
        """Close the gate and abort every live request; return once none is live. ``wait(timeout)``
        waits for a change (a request ended); aborts go again to the requests still live after it."""
        if self._open is None:
            self._open = asyncio.Event()
        self._open.clear()
        sent: dict[str, float] = {}
        loop = asyncio.get_running_loop()
        while self.requests:
            for rid in [r for r in self.requests if loop.time() - sent.get(r, -1.0) >= 0.5]:
                sent[rid] = loop.time()
                await engine.abort(rid)
            await wait(0.5)

    def release(self) -> None:
        """Open the gate: the parked trajectories continue from their tokens."""
        if self._open is not None:
            self._open.set()


@dataclass
class ResumePlan:
    """What a resumed run does with a checkpoint's in-flight record (``plan_resume``)."""

    groups: list[Group] = field(default_factory=list)
    """Groups continued under their ids (``RolloutScheduler.resume_groups``)."""
    scored: list[bool] = field(default_factory=list)
    """Per continued group: it was scored, waiting for buffer room (it goes to the buffer as it is)."""
    prompts: list[Prompt] = field(default_factory=list)
    """Prompts of the groups retracted now, back to the data source."""
    reasons: Counter[str] = field(default_factory=Counter)
    """Groups retracted (now or at the checkpoint), by reason."""

    def apply(self, scheduler: Any, return_prompt: Callable[[Prompt], None]) -> dict[str, float]:
        """Before the scheduler starts: retracted prompts back to the data source, the rest restarted;
        returns ``metrics()``."""
        for prompt in self.prompts:
            return_prompt(prompt)
        scheduler.resume_groups(self.groups, self.scored)
        return self.metrics()

    def metrics(self) -> dict[str, float]:
        """The ``resume/...`` figures of the first step after the resume."""
        kept = sum(len(s.response_ids) for g in self.groups for s in g.samples)
        return {"resume/in_flight_continued": float(len(self.groups)), "resume/in_flight_retracted": float(sum(self.reasons.values())),
                "resume/in_flight_tokens_kept": float(kept)}  # fmt: skip

    def describe(self) -> str:
        partial = sum(s.status is Status.PENDING and bool(s.response_ids) for g in self.groups for s in g.samples)
        m = self.metrics()
        line = (f"in flight at the checkpoint: {len(self.groups)} groups continued ({partial} trajectories from their "
                f"tokens, {m['resume/in_flight_tokens_kept']:.0f} tokens kept); {sum(self.reasons.values())} retracted")  # fmt: skip
        return line + "".join(f"; {n} because {reason}" for reason, n in self.reasons.items())


def plan_resume(record: dict[str, Any], version: int, rollout: Any) -> ResumePlan:
    """Each group of a checkpoint's ``in_flight`` record continued or retracted, by
    ``in_flight_policy(rollout)`` and, for each group, ``retract_reason`` at the checkpoint's ``version``."""
    policy, why = in_flight_policy(rollout)
    plan = ResumePlan()
    if record.get("retracted"):  # retracted when the checkpoint was written: their prompts are in its data cursor
        plan.reasons[record.get("reason") or "retracted at the checkpoint"] += len(record["retracted"])
    for data in record.get("groups", []):
        group = group_from_dict(data)
        reason = why if policy == "retract" else retract_reason(group, version, rollout.max_staleness)
        if reason is None:
            plan.groups.append(group)
            plan.scored.append(bool(data.get("scored")))
        else:
            plan.prompts.append(group.prompt)
            plan.reasons[reason] += 1
    return plan
