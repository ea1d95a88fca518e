"""Contract tests of the three rollout plug-in layers (agent, generate, rollout function), loaded by
import path from ``tests/agent_plugins.py``, on the built-in engine with a tiny random model (CPU)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from noria.plugins import PluginError, load_plugin
from noria.config import EngineConfig, RewardConfig, RolloutConfig
from noria.rollout import LocalEngineClient, RolloutContext
from noria.rollout.generate import run_rollout
from noria.types import Prompt, Status
from repo_util import ROOT


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from noria.engine import Engine

    e = Engine.from_path(tiny_model_dir, EngineConfig(kv_cache_tokens=8192), dtype="float32", seed=0)
    yield e
    e.shutdown(drain_timeout_s=1.0)


def rollout(engine, reward="toy_rewards:digits", n_samples=2, n_prompts=2, **cfg):
    config = RolloutConfig(n_samples=n_samples, max_new_tokens=5, temperature=1.0, **cfg)
    config.validate()
    ctx = RolloutContext(LocalEngineClient(engine), engine.tokenizer, config, seed=3)
    prompts = [(Prompt(f"What is {i} + 2?", label=str(i + 2), index=i), engine.tokenizer.encode(f"What is {i} + 2?")) for i in range(n_prompts)]
    return asyncio.run(run_rollout(ctx, prompts, 10, n_samples, RewardConfig(name=reward)))


def check_invariants(groups, first=10):
    for i, g in enumerate(groups):
        assert g.group_id == first + i
        for s in g.samples:
            n = len(s.response_ids)
            assert len(s.loss_mask) == len(s.rollout_logprobs) == len(s.weight_versions) == n
            assert all(lp == 0.0 and v == -1 for m, lp, v in zip(s.loss_mask, s.rollout_logprobs, s.weight_versions) if not m)


def test_agent_function_layer(engine):
    result = rollout(engine, reward="agent_plugins:digits_of_final", agent_fn="agent_plugins:two_turn_agent")
    check_invariants(result.groups)
    for g in result.groups:
        for s in g.samples:
            assert s.session_id and s.metadata["turns"] == 2 and s.status in (Status.COMPLETED, Status.TRUNCATED)
            assert 0 < sum(s.loss_mask) < len(s.loss_mask)  # policy turns 1, template + observation 0
            assert s.reward is not None and "final_answer" in s.metadata
    assert result.counts.scored == 4
    assert len({s.session_id for g in result.groups for s in g.samples}) == 4


def test_agent_result_sets_reward_and_status(engine):
    result = rollout(engine, agent_fn="agent_plugins:scoring_agent")
    samples = [s for g in result.groups for s in g.samples]
    assert all(s.reward == 0.25 and s.status is Status.TRUNCATED and s.metadata["scored_by"] == "agent" for s in samples)
    assert result.counts.scored == 0  # the reward function ran on nothing


def test_agent_failures_become_failed_samples(engine):
    failed = rollout(engine, agent_fn="agent_plugins:raising_agent")
    assert all(s.status is Status.FAILED and "environment crashed" in s.status_reason and s.reward is None for g in failed.groups for s in g.samples)
    slow = rollout(engine, agent_fn="agent_plugins:slow_agent", agent_timeout_s=0.2, n_prompts=1, n_samples=1)
    s = slow.groups[0].samples[0]
    assert s.status is Status.FAILED and "timed out" in s.status_reason


def test_generate_function_layer(engine):
    result = rollout(engine, generate_fn="agent_plugins:env_step_generate")
    check_invariants(result.groups)
    for s in (s for g in result.groups for s in g.samples):
        assert s.response_ids[-3:] == [5, 6, 7] and s.loss_mask[-3:] == [0, 0, 0] and sum(s.loss_mask) >= 1
    assert result.counts.scored == 4


def test_rollout_function_layer(engine):
    result = rollout(engine, rollout_fn="agent_plugins:constant_rollout", n_prompts=3)
    check_invariants(result.groups)
    assert [g.group_id for g in result.groups] == [10, 11, 12]
    assert [s.reward for g in result.groups for s in g.samples] == [1.0, 1.0, 1.0]  # scored: "12" is all digits
    with pytest.raises(PluginError, match="1 mask"):
        rollout(engine, rollout_fn="agent_plugins:broken_rollout")


def test_import_path_errors():
    with pytest.raises(PluginError, match="async"):
        load_plugin("agent_plugins:not_async", "rollout.generate_fn")
    with pytest.raises(PluginError, match="no 'missing'"):
        load_plugin("agent_plugins:missing", "rollout.agent_fn")
    with pytest.raises(PluginError, match="cannot import"):
        load_plugin("no_such_module_xyz:fn", "rollout.rollout_fn")
    from noria.config import ConfigError

    with pytest.raises(ConfigError, match="at most one"):
        dataclasses.replace(RolloutConfig(), agent_fn="a:b", generate_fn="c:d").validate()


@pytest.mark.parametrize(
    "layer, path",
    [
        ("agent_fn", "agent_layers:guess_then_check_agent"),
        ("generate_fn", "agent_layers:self_check_generate"),
        ("rollout_fn", "agent_layers:best_of_two_rollout"),
    ],
)
def test_examples_keep_the_contract(engine, monkeypatch, layer, path):

    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    result = rollout(engine, **{layer: path})
    check_invariants(result.groups)
    samples = [s for g in result.groups for s in g.samples]
    assert len(samples) == 4 and all(s.reward is not None and s.n_policy_tokens > 0 for s in samples)
    if layer != "rollout_fn":
        assert all(0 in s.loss_mask for s in samples)  # environment tokens are in the trajectory, masked
