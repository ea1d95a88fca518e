"""RL on a tiny random Qwen3-MoE with rollout routing replay: the reward rises, sync and async.

Everything is real (the engine in process or as ``noria serve``, the trainer, the weight sync, the
reward by import path); ``rollout.routing_replay`` makes the engine return every policy token's
routes and the trainer compute with them, which ``moe/route_mismatch`` = 0 shows on every step.
"""

from __future__ import annotations

import pytest

from moe_util import tiny_moe_folder
from noria.config import load_config
from noria.launch.rl import run_rl
from rl_util import async_args, mean, read_jsonl, rewards, rl_args, run_spied


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tiny_model_dir):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tiny_model_dir))
    return tiny_moe_folder(tmp_path_factory.mktemp("moe-rl"), tokenizer_dir=tiny_model_dir, vocab=vocab, std=0.02)


def check_replayed(run) -> list[dict]:
    rows = read_jsonl(run / "metrics.jsonl")
    assert all(r["moe/route_mismatch"] == 0.0 for r in rows)
    return rows


def test_moe_rl_with_replay_learns(moe_dir, tmp_path):
    run = tmp_path / "run"
    config = load_config(None, rl_args(moe_dir, **{"train.max_steps": 30, "rollout.routing_replay": True}))
    run_rl(config, run_dir=str(run), progress=False)
    check_replayed(run)
    got = rewards(run)
    assert mean(got[-5:]) > mean(got[:5]) + 0.15, got


def test_async_moe_rl_with_replay_learns(moe_dir, tmp_path):
    run = tmp_path / "run"
    args = {"train.max_steps": 40, "rollout.routing_replay": True, "reward.name": "toy_rewards:digits"}
    run_spied(load_config(None, async_args(moe_dir, **args)), run)
    rows = check_replayed(run)
    assert max(r["buffer/staleness_max"] for r in rows) == 1  # it did run ahead of the trainer
    got = rewards(run)
    assert mean(got[-8:]) > mean(got[:8]) + 0.1, got  # 16 samples a step: a noisier curve
