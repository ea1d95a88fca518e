"""verifiers environments (PyPI ``verifiers``, v1 API) as Noria agent functions.

What this module owns: ``VerifiersAgent``, an agent function (``rollout.agent_fn``, ``noria.plugins``) that plays one
episode of a verifiers environment per Noria sample, and ``NoriaChatHarness``, the in-process
verifiers harness it pins on the environment's agent seat.

Why the agent-function layer: a verifiers environment talks to its model through an
OpenAI-compatible endpoint, and Noria's session server is exactly that, one per sample, recording
every token the engine sampled. So the environment owns the task, the turns and the rewards;
Noria owns the tokens. How one sample moves::

    Prompt.metadata["vf_task"] --task class--> verifiers Task
    Env.run_episode(task, ModelContext(base_url = the sample's session URL))
        env.run() drives the agent seat (one or many turns; the env may play the user)
        NoriaChatHarness -> verifiers interception server (127.0.0.1, records the trace)
            -> EvalClient -> session server /sessions/<id>/v1/chat/completions -> engine
        trace scored by the task's @vf.reward functions
    episode --outcome()--> {"reward": trace.reward, "metadata": {...}} (or FAILED, with reason)

Prompts: each Noria prompt carries its verifiers task as wire data in ``metadata["vf_task"]``.
``VerifiersAgent.write_jsonl`` writes a taskset's tasks as a Noria data file (``prompt``,
``label``, ``vf_task``); the config lists ``vf_task`` in ``data.metadata_keys``.

Harness: verifiers' own chat harnesses (``null``, ``bash``) run a program under ``uv`` that
downloads its dependencies on first use; ``NoriaChatHarness`` is a chat loop run in process (the
harness contract allows it: every model call still goes through the interception endpoint), one
model call per segment, no tools. Runtime: ``subprocess`` (local; the harness runs nothing in it).

Statuses: any episode or trace error (environment, harness, model call, reward) makes the sample
FAILED with the error as reason, never a zero reward; so does a reward the environment left
unscored, or an episode with more than one agent run (one session records one conversation).
The environment's rewards are summed with their weights (``Trace.reward``); a scored episode keeps
the session's status (COMPLETED, or TRUNCATED when its last turn hit ``rollout.max_new_tokens``).

Not guaranteed: tool servers (MCP toolsets) are refused; a multi-agent environment fails the sample
(its seats would share one session);
verifiers resolves plugins by top-level module name, so this module and environments shipped in
Noria register top-level aliases (``noria_verifiers``, ...) in ``sys.modules`` on import and
resolve only in a process that imported them; episodes are not retried (a retry would re-send a
conversation the session already recorded).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

HARNESS_ID = "noria_verifiers"
"""The verifiers harness id of ``NoriaChatHarness`` (this module's top-level alias)."""
TASK_KEY = "vf_task"
"""Prompt metadata key holding the verifiers task's wire data."""
MODEL_NAME = "noria-policy"
API_KEY_VAR = "NORIA_SESSION_API_KEY"
"""Read by verifiers' client; unset is fine (the session server takes no key)."""

sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])


class NoriaChatHarnessConfig(vf.HarnessConfig):
    """No settings of its own: sampling and lengths come from Noria's rollout config."""


class NoriaChatHarness(vf.Harness[NoriaChatHarnessConfig]):
    """A tool-less chat harness run in process: each segment sends the conversation once."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True  # a later segment is the whole conversation sent again (verifiers' resume)
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        if mcp_urls:
            return vf.ProgramResult(2, "", f"harness {HARNESS_ID!r} runs no tool servers; got {sorted(mcp_urls)}")
        system, prompt = self.resolve_prompt(data)
        messages = [] if system is None else [{"role": "system", "content": system}]
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or []]
        async with httpx.AsyncClient(timeout=None) as http:
            r = await http.post(
                f"{endpoint}/chat/completions",
                headers={"Authorization": f"Bearer {secret}"},
                json={"model": ctx.model, "messages": messages},
            )
        if r.status_code != 200:
            return vf.ProgramResult(1, "", f"model call answered HTTP {r.status_code}: {r.text[-2000:]}")
        return vf.ProgramResult(0, r.json()["choices"][0]["message"].get("content") or "", "")


class VerifiersAgent:
    """Agent function playing episodes of the verifiers environment of ``taskset`` (an id).

    ``taskset_args`` are the taskset's config fields; ``env`` names a paired verifiers env (empty:
    the taskset's own, else ``SingleAgentEnv``); ``harness`` the seat's harness id.
    """

    def __init__(self, taskset: str, taskset_args: dict[str, Any] | None = None, env: str = "", harness: str = HARNESS_ID):
        self.taskset_id, self.env_id, self.harness_id = taskset, env, harness
        self.taskset_args = dict(taskset_args or {})
        self._env: vf.Env | None = None

    def config(self) -> vf.EnvConfig:
        """The environment's config: every agent seat pinned to the harness, local runtime."""
        cls = vf.env_config_type(self.taskset_id, self.env_id)
        raw: dict[str, Any] = {"id": self.env_id, "taskset": {"id": self.taskset_id, **self.taskset_args}}
        for name, field in cls.model_fields.items():
            if isinstance(field.default, vf.AgentConfig):
                raw[name] = {"harness": {"id": self.harness_id}, "runtime": {"type": "subprocess"}}
        return cls.model_validate(raw)

    @property
    def env(self) -> vf.Env:
        if self._env is None:
            self._env = vf.load_environment(self.config())
        return self._env

    def task_for(self, prompt: Any) -> vf.Task:
        """The verifiers task a Noria prompt carries (``metadata["vf_task"]``)."""
        wire = (prompt.metadata or {}).get(TASK_KEY)
        if wire is None:
            raise ValueError(
                f"prompt {prompt.index} has no {TASK_KEY!r} metadata: write the data with VerifiersAgent.write_jsonl "
                f"and list {TASK_KEY} in data.metadata_keys"
            )
        task_cls = type(self.env.taskset).task_type()
        return task_cls(task_cls.data_type().model_validate(wire), self.env.taskset.config.task)

    async def __call__(self, ctx: Any, prompt: Any, base_url: str) -> dict[str, Any]:
        """Agent function: one episode against the session at ``base_url``; see ``outcome``."""
        client = vf.EvalClientConfig(base_url=base_url, api_key_var=API_KEY_VAR)
        episode = await self.env.run_episode(self.task_for(prompt), vf.ModelContext(model=MODEL_NAME, client=client))
        return outcome(episode)

    def rows(self, start: int = 0, count: int | None = None) -> list[dict[str, Any]]:
        """Noria data rows for tasks ``start .. start+count`` of the taskset (in its order)."""
        view = self.env.taskset.skip(start)
        if count is not None:
            view = view.take(count)
        return [task_row(task) for task in view]

    def write_jsonl(self, path: str | Path, start: int = 0, count: int | None = None) -> int:
        """Write ``rows(start, count)`` as JSONL; returns the number of rows."""
        rows = self.rows(start, count)
        Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return len(rows)


def task_row(task: vf.Task) -> dict[str, Any]:
    """One Noria data row: the prompt text (for length checks and logs), a label, the task."""
    data = task.data
    label = data.id or data.name or task.key
    return {"prompt": data.prompt_text, "label": label, TASK_KEY: data.model_dump(mode="json", exclude_defaults=True)}


def outcome(episode: vf.Episode) -> dict[str, Any]:
    """The agent function's result for a finished episode (statuses: module docstring)."""
    traces = list(episode.traces)
    meta: dict[str, Any] = {"vf_env": episode.env.id}
    if len(traces) == 1:
        t = traces[0]
        meta.update({
            "vf_rewards": {k: None if r is None else r.score for k, r in t.rewards.items()},
            "vf_metrics": dict(t.metrics),
            "vf_turns": t.num_turns,
            "vf_stop": t.stop_condition,
            "vf_info": json.loads(json.dumps(t.info, default=str)),
        })  # fmt: skip
    errors = [*episode.errors, *(e for t in traces for e in t.errors)]
    if errors:
        e = errors[0]
        return failed(f"verifiers {e.type}: {e.message}"[:2000], meta)
    if len(traces) != 1:
        return failed(f"the episode ran {len(traces)} agent runs; a Noria session records one conversation", meta)
    unscored = [k for k, r in traces[0].rewards.items() if r is None]
    if unscored or not traces[0].rewards:
        return failed(f"the environment left reward(s) {unscored or 'all'} unscored", meta)
    return {"reward": traces[0].reward, "metadata": meta}


def failed(reason: str, meta: dict[str, Any]) -> dict[str, Any]:
    return {"status": "failed", "status_reason": reason, "metadata": meta}


def unscored(response: str, label: Any, metadata: dict[str, Any]) -> float:
    """``reward.name`` for verifiers runs: never called (the agent scores or fails every sample); raises if it is."""
    raise RuntimeError("a verifiers episode ended without the environment's reward; see the sample's vf_* metadata")


# verifiers loads a harness module by the one Harness subclass its __all__ names.
__all__ = ["NoriaChatHarness", "NoriaChatHarnessConfig", "VerifiersAgent", "outcome", "task_row", "unscored"]
