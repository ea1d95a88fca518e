"""Contract tests of every plug point (noria.plugins.PLUG_POINTS), as slime's tests/plugin_contracts do.

Per plug point: the built-in default still has the signature its record says callers use; a
plug-in that meets the contract loads (and, where that needs no engine, behaves as its caller
expects); one that breaks it is refused at load with an error naming the config key and the path.

Check your own plug-in against its point without running a job::

    NORIA_CONTRACT_ROLLOUT_GENERATE_FN=my_pkg.gen:generate pytest tests/test_plugin_contracts.py

(the variable is ``NORIA_CONTRACT_`` + the config key in capitals, dots as underscores).
"""

from __future__ import annotations

import asyncio
import inspect
import os

import pytest

from noria.plugins import PLUG_POINTS, PluginError, load_plugin
from noria.types import Group, Prompt, Sample, Status

EXAMPLES = {
    "rollout.rollout_fn": "agent_plugins:constant_rollout",
    "rollout.generate_fn": "agent_plugins:env_step_generate",
    "rollout.agent_fn": "agent_plugins:two_turn_agent",
    "reward.name": "reward_plugins:length_at_least",
    "rollout.buffer.filters": "buffer_plugins:drop_odd",
    "rollout.buffer.impl": "buffer_plugins:ListBuffer",
    "eval.backend": "eval_plugins:SlowFlakyBackend",
}
"""A plug-in per point that meets its contract (the tests' own, used by the behaviour tests too)."""

BROKEN = {
    "rollout.rollout_fn": ("test_plugin_contracts:rollout_without_prompts", "cannot be called as \\(ctx, prompts\\)"),
    "rollout.generate_fn": ("agent_plugins:not_async", "must be an async function"),
    "rollout.agent_fn": ("test_plugin_contracts:agent_without_url", "cannot be called as \\(ctx, prompt, base_url\\)"),
    "reward.name": ("test_plugin_contracts:reward_of_response_only", "cannot be called as \\(response, label, metadata\\)"),
    "rollout.buffer.filters": ("test_plugin_contracts:async_filter", "must be a plain function"),
    "rollout.buffer.impl": ("test_plugin_contracts:BufferWithoutState", "lacks state_dict, load_state_dict"),
    "eval.backend": ("eval_plugins:BackendWithoutEvaluate", "lacks evaluate"),
}
"""A plug-in per point that breaks its contract, and what the error must say."""


def user_path(key: str) -> str:
    return os.environ.get("NORIA_CONTRACT_" + key.upper().replace(".", "_"), EXAMPLES[key])


def test_every_plug_point_is_covered():
    assert set(PLUG_POINTS) == set(EXAMPLES) == set(BROKEN)


@pytest.mark.parametrize("key", [k for k, p in PLUG_POINTS.items() if p.default])
def test_the_default_has_the_signature_its_callers_use(key):
    point = PLUG_POINTS[key]
    default = load_plugin(point.default, key)
    target = default.__init__ if point.kind == "class" else default
    names = [n for n in inspect.signature(target).parameters if n != "self"]
    assert tuple(names[: len(point.params)]) == point.params, f"{point.default}{inspect.signature(target)}"


@pytest.mark.parametrize("key", list(PLUG_POINTS))
def test_a_plugin_that_meets_the_contract_loads_and_behaves(key):
    path = user_path(key)
    obj = load_plugin(path, key)
    BEHAVIOUR.get(key, lambda obj, path: None)(obj, path)


@pytest.mark.parametrize("key", list(PLUG_POINTS))
def test_a_plugin_that_breaks_the_contract_is_refused_naming_key_and_path(key):
    path, why = BROKEN[key]
    with pytest.raises(PluginError, match=f"^{key}: .*{why}") as e:
        load_plugin(path, key)
    assert path.split(":")[1] in str(e.value)


def test_bad_paths_name_the_key():
    with pytest.raises(PluginError, match="rollout.generate_fn: 'no_colon' is not an import path"):
        load_plugin("no_colon", "rollout.generate_fn")
    with pytest.raises(PluginError, match="rollout.buffer.impl: cannot import 'no_such_module_xyz'"):
        load_plugin("no_such_module_xyz:Buf", "rollout.buffer.impl")
    with pytest.raises(PluginError, match="rollout.buffer.impl: 'buffer_plugins:drop_odd' names a function, not a class"):
        load_plugin("buffer_plugins:drop_odd", "rollout.buffer.impl")


# ------------------------------------------------------------------------------ behaviour (no engine needed)


def _group(rewards=(1.0, 0.0), gid=3) -> Group:
    samples = tuple(
        Sample([1, 2], [3, 4], [1, 1], [-0.5, -0.5], [0, 0], reward=r, status=Status.COMPLETED, group_id=gid, index=i)
        for i, r in enumerate(rewards)
    )
    return Group(group_id=gid, prompt=Prompt("p", "l", {}, gid, "test"), samples=samples)


def _reward_behaves(fn, path):
    out = fn("some answer", "label", {})
    out = asyncio.run(out) if inspect.isawaitable(out) else out
    assert isinstance(out, (int, float, bool)), f"{path} returned {type(out).__name__}"


def _filter_behaves(fn, path):
    out = fn(_group())
    assert out is None or isinstance(out, str), f"{path} returned {type(out).__name__}, not None or a reason"


def _buffer_behaves(cls, path):
    from buffer_util import check_buffer_contract

    check_buffer_contract(path)


BEHAVIOUR = {"reward.name": _reward_behaves, "rollout.buffer.filters": _filter_behaves, "rollout.buffer.impl": _buffer_behaves}
"""The generate, rollout and agent functions need an engine: tests/agent/test_agent_plugins.py runs them; an
eval.backend needs a run: tests/eval/test_eval_modes.py runs one."""


# ------------------------------------------------------------------------------ contract breakers


async def rollout_without_prompts(ctx):
    return []


async def agent_without_url(ctx, prompt):
    return {}


def reward_of_response_only(response):
    return 0.0


async def async_filter(group):
    return None


class BufferWithoutState:
    def __init__(self, capacity, max_staleness=0, filters=(), on_drop=None):
        pass

    async def put(self, group):
        return True

    def take(self, n, version):
        return []

    def metrics(self, version):
        return {}

    def __len__(self):
        return 0


# ------------------------------------------------------------------------------ rewards: TRL's batched form


def _scored(path, groups, **cfg):
    from noria.config import RewardConfig
    from noria.rewards import score_groups

    counts = score_groups(groups, RewardConfig(name=path, **cfg))
    return counts, [s.reward for g in groups for s in g.samples], [s.status_reason for g in groups for s in g.samples]


def _answers(prompt, texts, metadata=None, label="7", gid=0):
    samples = tuple(Sample([1], [5] * (i + 1), [1] * (i + 1), [-0.1] * (i + 1), [0] * (i + 1), group_id=gid, index=i,
                           response_text=t) for i, t in enumerate(texts))  # fmt: skip
    return Group(group_id=gid, prompt=Prompt(prompt, label, metadata or {}, gid, "test"), samples=samples)


def test_the_per_sample_form_and_the_trl_form_both_load():
    from noria.plugins import is_batched

    point = PLUG_POINTS["reward.name"]
    assert not is_batched(load_plugin("reward_plugins:length_at_least", "reward.name"), point)
    for name in ("reward_len", "reward_func", "format_reward_func", "async_reward"):
        assert is_batched(load_plugin(f"trl_rewards:{name}", "reward.name"), point)


def test_trl_docs_rewards_score_unchanged_with_dataset_columns():
    # example 3 reads the dataset column `ground_truth` (a metadata key here, as data.metadata_keys keeps it)
    group = _answers("What is 3 + 4?", [r"\boxed{7}", r"\boxed{8}", "seven"], {"ground_truth": "7"})
    counts, rewards, _ = _scored("trl_rewards:reward_func", [group])
    assert rewards == [1.0, 0.0, 0.0] and counts.scored == 3
    _, rewards, _ = _scored("trl_rewards:reward_len", [_answers("p", ["x" * 20, "x" * 25])])
    assert rewards == [0.0, -5.0]
    # conversational prompts (chat messages) get completions as one assistant message, as in TRL
    chat = ({"role": "user", "content": "think, then answer"},)
    _, rewards, _ = _scored("trl_rewards:format_reward_func", [_answers(chat, ["<think>a</think><answer>b</answer>", "b"])])
    assert rewards == [1.0, 0.0]
    _, rewards, _ = _scored("trl_rewards:async_reward", [_answers("odd", ["a", "b"]), _answers("even", ["c"], gid=1)])
    assert rewards == [1.0, 1.0, 0.0]


def test_trl_docs_think_format_reward_from_the_trl_package():
    rewards_module = pytest.importorskip("trl.rewards")
    assert callable(rewards_module.think_format_reward)
    chat = ({"role": "user", "content": "q"},)
    _, rewards, _ = _scored("trl.rewards:think_format_reward", [_answers(chat, ["<think>\nr\n</think>\na", "a"])])
    assert rewards == [1.0, 0.0]


def test_a_batched_reward_that_breaks_its_contract_fails_loudly():
    with pytest.raises(PluginError, match="reward.name: .*without_kwargs.*cannot be called as \\(completions=, prompts="):
        load_plugin("trl_rewards:without_kwargs", "reward.name")
    counts, rewards, reasons = _scored("trl_rewards:wrong_length", [_answers("p", ["a", "b"])])
    assert rewards == [None, None] and counts.failed["not_a_number"] == 2
    assert "returned a list of 1 for 2 completions" in reasons[0]
    # a column the function needs but the data lacks: every sample fails, naming it (never a silent 0)
    counts, rewards, reasons = _scored("trl_rewards:reward_func", [_answers("p", ["a"])])
    assert rewards == [None] and "ground_truth" in reasons[0]
