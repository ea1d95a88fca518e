"""Guess the number: a multi-turn verifiers environment in which the game engine plays the user.

Written against verifiers' v1 API (taskset, task with ``@vf.reward`` functions, and an ``Env``
whose ``run()`` steps the game host-side, as verifiers' own TextArena environment does): the
model guesses a secret whole number in ``[low, high]``; after each reply the environment answers
"higher", "lower" or "reply with a number" as the next user turn, until a guess hits or
``max_guesses`` replies were given. A reply's guess is its first integer ("I say 42." -> 42).

Rewards (summed with weights by the trace, so the episode's reward is in [0, 1]; recorded
unweighted per name in the sample's ``vf_rewards``):

=============  ======  ==========================================================
reward         weight  value
=============  ======  ==========================================================
``solved``     0.75    1 if a guess hit the secret, else 0
``closeness``  0.25    1 - |best guess - secret| / (high - low), clipped at 0; 0 without a guess
=============  ======  ==========================================================

Metrics: ``guesses`` (replies given), ``valid_guesses`` (replies holding a number).

Noria use: ``rollout.agent_fn: noria.agent.envs.guess_number:agent`` with data written by
``agent.write_jsonl`` (``python -m noria.agent.envs.guess_number OUT.jsonl START COUNT``).
Tasks are drawn from ``seed`` per index, so a split is an index range.
"""

from __future__ import annotations

import random
import re
import sys
from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf

from noria.agent.envs.verifiers_env import VerifiersAgent

TASKSET_ID = "noria_guess_number"
sys.modules.setdefault(TASKSET_ID, sys.modules[__name__])  # verifiers resolves tasksets by top-level name

_INT = re.compile(r"-?\d+")


class GuessConfig(vf.TasksetConfig):
    num_tasks: int = 10_000
    """Tasks in the taskset (index 0 .. num_tasks - 1)."""
    seed: int = 0
    low: int = 1
    high: int = 20
    max_guesses: int = 3


class GuessData(vf.TaskData):
    secret: int
    low: int
    high: int
    max_guesses: int


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=0.75)
    async def solved(self, trace) -> float:
        return float(game_record(trace)["solved"])

    @vf.reward(weight=0.25)
    async def closeness(self, task, trace) -> float:
        best = game_record(trace)["best"]
        if best is None:
            return 0.0
        return max(0.0, 1.0 - abs(best - task.secret) / (task.high - task.low))

    @vf.metric
    async def guesses(self, trace) -> float:
        return float(len(game_record(trace)["guesses"]))

    @vf.metric
    async def valid_guesses(self, trace) -> float:
        return float(sum(g is not None for g in game_record(trace)["guesses"]))


def game_record(trace) -> dict[str, Any]:
    """The game the env recorded on the trace (KeyError, so a failed scoring, if it never ran)."""
    return trace.info["game"]


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self) -> Iterator[GuessTask]:
        c = self.config
        for i in range(c.num_tasks):
            secret = random.Random(f"{c.seed}:{i}").randint(c.low, c.high)
            prompt = (
                f"Guess my number from {c.low} to {c.high}. Reply with one number; I will say higher or lower. "
                f"You have {c.max_guesses} guesses."
            )
            data = GuessData(
                id=f"guess-{c.seed}-{i}", prompt=prompt, secret=secret, low=c.low, high=c.high, max_guesses=c.max_guesses
            )
            yield GuessTask(data, c.task)


def parse_guess(reply: str) -> int | None:
    match = _INT.search(reply)
    return int(match.group()) if match else None


def feedback(guess: int | None, secret: int) -> str:
    if guess is None:
        return "Reply with a whole number."
    return "Higher." if guess < secret else "Lower."


def play(record: dict[str, Any], reply: str, data: GuessData) -> str | None:
    """Apply one reply to the game record; the next user turn, or None when the game is over."""
    guess = parse_guess(reply)
    record["guesses"].append(guess)
    if guess is not None and (record["best"] is None or abs(guess - data.secret) < abs(record["best"] - data.secret)):
        record["best"] = guess
    record["solved"] = record["solved"] or guess == data.secret
    if record["solved"] or len(record["guesses"]) >= data.max_guesses:
        return None
    return feedback(guess, data.secret)


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        d = task.data
        if not d.low < d.high or d.max_guesses < 1:
            raise ValueError(f"a game needs low < high and max_guesses >= 1; got {d.low}, {d.high}, {d.max_guesses}")
        record: dict[str, Any] = {"guesses": [], "best": None, "solved": False}
        async with agents.player.interaction(task) as interaction:
            interaction.trace.info["game"] = record
            segment = await interaction.turn()  # the prompt opens the game: the model guesses first
            while not segment.terminated:
                answer = play(record, segment.last_reply, task.data)
                if answer is None:
                    break
                segment = await interaction.turn(answer)


__all__ = ["GuessConfig", "GuessData", "GuessEnv", "GuessEnvConfig", "GuessTask", "GuessTaskset", "agent"]

agent = VerifiersAgent(TASKSET_ID)
"""The agent function: ``rollout.agent_fn: noria.agent.envs.guess_number:agent``."""


if __name__ == "__main__":
    out, start, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(f"wrote {agent.write_jsonl(out, start, count)} tasks to {out}")
