"""A real environment library at the agent-function layer: ``verifiers`` (PyPI, v1 API) episodes
of the guess-the-number environment (``noria.agent.envs.guess_number``), played by the built-in
engine on a tiny random model (CPU) through verifiers' interception server and Noria's session
server, loopback only.

Each sample is checked against what the engine produced (its policy tokens are the engine's
output ids of that session, turn by turn, with their logprobs) and against the game replayed
here from those tokens (the environment's feedback turns are in the record with mask 0, and the
reward is the environment's rubric applied to the replayed game).
"""

from __future__ import annotations

import asyncio
import re
from collections import defaultdict

import pytest

from noria.config import EngineConfig, RewardConfig, RolloutConfig
from noria.rollout import LocalEngineClient, RolloutContext
from noria.rollout.generate import run_rollout
from noria.types import Prompt, Status

AGENT = "noria.agent.envs.guess_number:agent"


class Recording:
    """An engine client that keeps every (input ids, output) pair, by routing key (the session id)."""

    def __init__(self, inner):
        self.inner, self.outputs = inner, defaultdict(list)

    async def generate(self, req, **kwargs):
        out = await self.inner.generate(req, **kwargs)
        self.outputs[req.routing_key].append((list(req.input_ids), out))
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from noria.engine import Engine

    e = Engine.from_path(tiny_model_dir, EngineConfig(kv_cache_tokens=8192), dtype="float32", seed=0)
    yield e
    e.shutdown(drain_timeout_s=1.0)


def rollout(engine, rows, n_samples=2, max_new_tokens=6):
    config = RolloutConfig(
        n_samples=n_samples, max_new_tokens=max_new_tokens, temperature=1.0, agent_fn=AGENT, agent_timeout_s=60
    )
    config.validate()
    client = Recording(LocalEngineClient(engine))
    ctx = RolloutContext(client, engine.tokenizer, config, seed=5)
    prompts = [
        (Prompt(r["prompt"], r["label"], {"vf_task": r["vf_task"]}, index=i), engine.tokenizer.encode(r["prompt"]))
        for i, r in enumerate(rows)
    ]
    result = asyncio.run(run_rollout(ctx, prompts, 0, n_samples, RewardConfig(name="toy_rewards:digits")))
    return result, client.outputs


def spans(mask: list[int], value: int) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of ``value`` in ``mask``."""
    out, start = [], None
    for i, m in enumerate([*mask, None]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            out.append((start, i))
            start = None
    return out


def replay(replies: list[str], task: dict) -> tuple[list[int | None], list[str], float]:
    """The game on these replies, written out independently: guesses, feedback turns, reward."""
    guesses, feedback, best, solved = [], [], None, False
    for reply in replies:
        found = re.search(r"-?\d+", reply)
        guess = int(found.group()) if found else None
        guesses.append(guess)
        if guess is not None and (best is None or abs(guess - task["secret"]) < abs(best - task["secret"])):
            best = guess
        solved = solved or guess == task["secret"]
        if solved or len(guesses) == task["max_guesses"]:
            break
        feedback.append("Reply with a whole number." if guess is None else "Higher." if guess < task["secret"] else "Lower.")
    closeness = 0.0 if best is None else max(0.0, 1 - abs(best - task["secret"]) / (task["high"] - task["low"]))
    return guesses, feedback, 0.75 * solved + 0.25 * closeness


def test_guess_number_episodes_through_the_session_server(engine):
    from noria.agent.envs.guess_number import agent

    rows = agent.rows(0, 2)
    assert [r["vf_task"]["idx"] for r in rows] == [0, 1] and all(r["vf_task"]["max_guesses"] == 3 for r in rows)
    result, outputs = rollout(engine, rows)
    samples = [s for g in result.groups for s in g.samples]
    assert len(samples) == 4 and result.counts.scored == 0  # the environment scored every episode
    tok = engine.tokenizer
    turns_seen = set()
    for s in samples:
        task = rows[s.group_id]["vf_task"]
        assert s.status in (Status.COMPLETED, Status.TRUNCATED), s.status_reason
        n = len(s.response_ids)
        assert len(s.loss_mask) == len(s.rollout_logprobs) == len(s.weight_versions) == n
        # Token-exact: the policy tokens are this session's engine outputs, turn by turn.
        turns = outputs[s.session_id]
        policy = spans(s.loss_mask, 1)
        assert [s.response_ids[a:b] for a, b in policy] == [list(o.output_ids) for _, o in turns]
        assert [s.rollout_logprobs[a:b] for a, b in policy] == [[float(x) for x in o.logprobs] for _, o in turns]
        assert all(m == 1 or (lp == 0.0 and v == -1) for m, lp, v in zip(s.loss_mask, s.rollout_logprobs, s.weight_versions))
        # Each turn's input was the record so far (the history was never re-tokenized).
        assert [ids for ids, _ in turns] == [s.prompt_ids + s.response_ids[:a] for a, _ in policy]
        # The game, replayed from the recorded replies, matches the environment's turns and reward.
        replies = [tok.decode(s.response_ids[a:b], skip_special_tokens=True) for a, b in policy]
        guesses, feedback, reward = replay(replies, task)
        assert len(policy) == len(guesses) == s.metadata["vf_turns"] <= 3
        assert s.metadata["vf_info"]["game"]["guesses"] == guesses
        between = [tok.decode(s.response_ids[a:b], skip_special_tokens=True) for a, b in spans(s.loss_mask, 0)]
        assert len(between) == len(feedback) and all(f in text for f, text in zip(feedback, between))
        assert s.reward == pytest.approx(reward) and set(s.metadata["vf_rewards"]) == {"solved", "closeness"}
        turns_seen.add(len(policy))
    assert len({s.session_id for s in samples}) == 4
    assert max(turns_seen) > 1  # multi-turn episodes happened


def test_environment_errors_fail_the_sample(engine):
    from noria.agent.envs.guess_number import agent

    row = agent.rows(0, 1)[0]
    broken = {**row, "vf_task": {**row["vf_task"], "max_guesses": 0}}  # the environment refuses the game
    result, _ = rollout(engine, [broken], n_samples=1)
    s = result.groups[0].samples[0]
    assert s.status is Status.FAILED and s.reward is None and result.counts.scored == 0
    assert "verifiers EnvError" in s.status_reason and "max_guesses" in s.status_reason, s.status_reason
    missing = {**row, "vf_task": None}  # a prompt that carries no task
    result, outputs = rollout(engine, [missing], n_samples=1)
    s = result.groups[0].samples[0]
    assert s.status is Status.FAILED and "vf_task" in s.status_reason and not outputs
