"""Agentic RL end to end on a tiny random model (CPU): the RL job with ``rollout.agent_fn`` runs
multi-turn episodes through the session server, trains on them, and the policy learns to call the
tool (``agent_plugins:tiny_tool_agent``: a reply holding the ``<tool_call>`` token calls it).

Marked ``slow``: 14 RL steps of 64 two-turn episodes take 1-3 minutes on the shared 2-core machine."""

from __future__ import annotations

import json

import pytest

from noria.config import load_config
from noria.launch.rl import run_rl
from tiny_util import build_tiny_llama, build_tokenizer


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-tool")
    tok = build_tokenizer(folder)
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>"]})
    tok.save_pretrained(folder)
    build_tiny_llama(folder, vocab_size=len(tok))
    return folder


def args(model, steps: int) -> list[str]:
    base = {
        "model.path": str(model),
        "data.task": "arithmetic",
        "data.task_args": "{n_train: 400, n_test: 16, max_operand: 30, ops: ['+']}",
        "reward.name": "toy_rewards:digits",  # unused: the agent scores every episode
        "rollout.agent_fn": "agent_plugins:tiny_tool_agent",
        "rollout.n_samples": 8,
        "rollout.prompts_per_step": 8,
        "rollout.max_new_tokens": 12,
        "train.optim.lr": "6e-3",
        "engine.kv_cache_tokens": 8192,
        "train.max_steps": steps,
        "eval.every": steps,
        "eval.max_new_tokens": 12,
    }
    return [x for k, v in base.items() for x in (f"--{k}", str(v))]


@pytest.mark.slow
def test_policy_learns_to_call_the_tool(tool_model_dir, tmp_path):
    steps = 14
    run = tmp_path / "run"
    run_rl(load_config(None, args(tool_model_dir, steps)), run_dir=str(run), progress=False)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["rollout/reward_mean"] for r in rows]
    assert len(rewards) == steps
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.15, rewards  # tool-call rate while training
    evals = {e["step"]: e["accuracy"] for e in map(json.loads, (run / "eval.jsonl").read_text().splitlines())}
    assert evals[steps] > evals[0], evals  # held-out, greedy
    sample = json.loads((run / "eval" / f"step-{steps:06d}.jsonl").read_text().splitlines()[0])
    assert sample  # the evaluation wrote its trajectories
