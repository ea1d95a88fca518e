"""The three nested rollout plug-in layers, loaded by import path ``pkg.module:fn`` (``noria.plugins``).

=================  ==========================================  ==============================
layer              signature                                   who records the tokens
=================  ==========================================  ==============================
rollout function   ``async (ctx, prompts) -> list[Group]``     it does (replaces everything)
generate function  ``async (ctx, sample) -> Sample``           it does
agent function     ``async (ctx, prompt, base_url) -> dict``   the session server
=================  ==========================================  ==============================

Contracts (signatures checked at load by ``noria.plugins.load_plugin`` and pinned by
``tests/test_plugin_contracts.py``; behaviour by ``tests/agent/test_agent_plugins.py``):

- rollout function: ``prompts`` is a list of ``(Prompt, prompt ids)``; ``ctx.first_group_id`` is
  the id of the first group and ``ctx.sampling.n_samples`` the group size. It returns one
  ``Group`` per prompt, in order, ids ``first_group_id + i``; each sample has
  ``len(response_ids) == len(loss_mask) == len(rollout_logprobs) == len(weight_versions)``.
  Samples it leaves unscored (``reward`` None) are scored by the configured reward.
- generate function: fills ``sample`` (``prompt_ids`` already set) with the same invariants and a
  final ``status``; returns it. Engine failures propagate.
- agent function: talks OpenAI chat completions to ``base_url`` (the session server, which records
  the tokens and routes by session). Returns a dict, all keys optional: ``reward`` (float; else
  the configured reward scores the trajectory), ``status`` (a ``Status`` value), ``status_reason``,
  ``metadata`` (merged into the sample's). An exception or a run past ``agent_timeout_s`` makes
  the sample FAILED with the reason, never a zero reward.

``agent_generate(agent_fn)`` is the generate function that runs an agent in a session;
``noria.rollout.generate.run_rollout`` picks the layer the config names.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from noria.plugins import PluginError
from noria.types import Sample, Status

AgentFn = Callable[[Any, Any, str], Awaitable[dict[str, Any]]]


def agent_generate(agent_fn: AgentFn, timeout_s: float = 600.0) -> Callable[[Any, Sample], Awaitable[Sample]]:
    """A generate function that runs ``agent_fn`` in a fresh session of ``ctx.session_server``."""

    async def generate(ctx: Any, sample: Sample) -> Sample:
        server = ctx.session_server
        if server is None:
            raise PluginError("agent functions need ctx.session_server (run_rollout starts it)")
        seed = None if ctx.greedy else ctx.seed_for(sample)
        session = server.open(f"g{sample.group_id}-s{sample.index}-{id(sample):x}", seed=seed)
        prompt = ctx.prompts.get(sample.group_id)
        result: dict[str, Any] = {}
        failure = ""
        try:
            result = await asyncio.wait_for(agent_fn(ctx, prompt, server.base_url(session.id)), timeout_s)
            if not isinstance(result, dict):
                failure = f"agent function returned {type(result).__name__}, not a dict"
        except TimeoutError:
            failure = f"agent timed out after rollout.agent_timeout_s={timeout_s:g} s"
        except Exception as e:  # classified: the agent's own error fails this sample only
            failure = f"agent raised {type(e).__name__}: {e}"
        finally:
            server.close(session.id)
        if session.engine_failure is not None:
            raise session.engine_failure
        return finish(session, sample, result if not failure else {}, failure)

    return generate


def finish(session: Any, sample: Sample, result: dict[str, Any], failure: str) -> Sample:
    """The sample from a closed session and the agent's result."""
    from noria.agent.session import session_status

    session.fill(sample)
    status, reason = session_status(session)
    if failure:
        status, reason = Status.FAILED, failure
    elif "status" in result:
        try:
            status, reason = Status(result["status"]), str(result.get("status_reason", ""))
        except ValueError:
            status, reason = Status.FAILED, f"agent returned an unknown status {result['status']!r}"
    sample.status, sample.status_reason = status, reason
    if result.get("reward") is not None and status is not Status.FAILED:
        sample.reward = float(result["reward"])
    sample.metadata.update(result.get("metadata") or {})
    return sample
