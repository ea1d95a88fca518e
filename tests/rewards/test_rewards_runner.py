"""The reward runner and the reward plug-point contract (CPU, fast).

Contract: a reward is ``(response, label, metadata, **kwargs) -> float | bool`` (or async), named in
the registry or loaded by import path; a reward that raises, hangs past the timeout or returns a
non-number / NaN marks its sample FAILED with a reason and leaves ``reward`` None, never 0.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
import reward_plugins

from noria.config import RewardConfig
from noria.plugins import PluginError
from noria.rewards import get_reward, register_reward, score, score_async, score_groups
from noria.types import Group, Prompt, Sample, Status
from repo_util import TESTS


@pytest.fixture(autouse=True, scope="module")
def release_hanging_rewards():
    reward_plugins.RELEASE.clear()
    yield
    reward_plugins.RELEASE.set()


def samples(*responses: str, status: Status = Status.COMPLETED) -> list[Sample]:
    return [Sample(prompt_ids=[1], response_text=r, status=status) for r in responses]


def test_tests_folder_is_importable():
    assert str(TESTS) in sys.path or str(Path.cwd()) in sys.path


def test_builtin_scores_and_counts():
    batch = samples("\\boxed{4}", "5", "4")
    counts = score(batch, RewardConfig(name="numeric"), ["4", "4", "4"])
    assert [s.reward for s in batch] == [1.0, 0.0, 1.0]
    assert all(s.status is Status.COMPLETED for s in batch)
    assert counts.scored == 3 and counts.n_failed == 0


def test_user_reward_by_import_path_with_kwargs():
    batch = samples("ab", "abcdef")
    score(batch, RewardConfig(name="reward_plugins:length_at_least", kwargs={"min_chars": 4}), [None, None])
    assert [s.reward for s in batch] == [0.0, 1.0]


def test_bool_reward_and_metadata():
    batch = samples("yes", "no")
    for s in batch:
        s.metadata["expected"] = "yes"
    score(batch, RewardConfig(name="reward_plugins:matches_metadata"), [None, None])
    assert [s.reward for s in batch] == [1.0, 0.0]


def test_async_user_reward():
    batch = samples("a", "b")
    score(batch, RewardConfig(name="reward_plugins:async_exact"), ["a", "a"])
    assert [s.reward for s in batch] == [1.0, 0.0]


@pytest.mark.parametrize(
    ("name", "kind", "reason"),
    [
        ("raises", "raised", "raised RuntimeError: checker crashed"),
        ("raises_timeout_error", "raised", "raised TimeoutError: the checker's own timeout"),
        ("returns_text", "not_a_number", "returned str '1.0', not a number"),
        ("returns_none", "not_a_number", "returned NoneType None, not a number"),
        ("returns_nan", "non_finite", "returned nan, not a finite number"),
        ("hangs", "timeout", "timed out after 0.2 s"),
        ("async_hangs", "timeout", "timed out after 0.2 s"),
    ],
)
def test_failures_mark_the_sample_failed_never_zero(name, kind, reason):
    batch = samples("x", "y")
    counts = score(batch, RewardConfig(name=f"reward_plugins:{name}", timeout_s=0.2), [None, None])
    for s in batch:
        assert s.status is Status.FAILED and s.reward is None
        assert reason in s.status_reason and name in s.status_reason
    assert counts.scored == 0 and counts.failed == {kind: 2}
    assert counts.as_metrics()[f"reward/failed/{kind}"] == 2


def test_hanging_rewards_run_concurrently_and_do_not_block_slots():
    batch = samples(*["x"] * 6)
    start = time.monotonic()
    counts = score(batch, RewardConfig(name="reward_plugins:hangs", timeout_s=0.3), [None] * 6, max_concurrency=2)
    elapsed = time.monotonic() - start
    assert counts.failed == {"timeout": 6}
    assert elapsed < 0.3 * 6  # three waves of two, not six calls one after another
    after = samples("abc")
    score(after, RewardConfig(name="reward_plugins:length_at_least"), [None], max_concurrency=1)
    assert after[0].reward == 1.0  # abandoned calls do not hold a slot


def test_failed_and_aborted_samples_are_skipped():
    batch = samples("4") + samples("4", status=Status.ABORTED) + samples("4", status=Status.FAILED)
    counts = score(batch, RewardConfig(name="numeric"), ["4"] * 3)
    assert [s.reward for s in batch] == [1.0, None, None] and counts.skipped == 2


def test_score_groups_uses_prompt_label_and_metadata():
    prompt = Prompt("q", label="ok", metadata={"expected": "yes"})
    group = Group(group_id=0, prompt=prompt, samples=tuple(samples("yes", "no")))
    score_groups([group], RewardConfig(name="reward_plugins:matches_metadata"))
    assert group.rewards == [1.0, 0.0]


def test_score_async_inside_a_loop_and_sync_score_refused_there():
    async def main():
        batch = samples("a")
        await score_async(batch, RewardConfig(name="exact_match"), ["A"])
        with pytest.raises(RuntimeError, match="score_async"):
            score(batch, RewardConfig(name="exact_match"), ["A"])
        return batch[0].reward

    assert asyncio.run(main()) == 1.0


def test_registry_errors():
    with pytest.raises(PluginError, match="reward.name: unknown reward 'nope'.*exact_match"):
        get_reward("nope")
    with pytest.raises(PluginError, match="reward.name: cannot import 'no_such_module_xyz'.*ModuleNotFoundError"):
        get_reward("no_such_module_xyz:fn")
    with pytest.raises(PluginError, match="reward.name: module 'reward_plugins' has no 'missing'"):
        get_reward("reward_plugins:missing")
    with pytest.raises(PluginError, match="reward.name: 'reward_plugins:NOT_CALLABLE' names a int, not a function"):
        get_reward("reward_plugins:NOT_CALLABLE")
    with pytest.raises(ValueError, match="already registered"):
        register_reward("numeric", reward_plugins.raises)
    with pytest.raises(ValueError, match="length"):
        score(samples("a"), RewardConfig(name="numeric"), [])
    with pytest.raises(ValueError, match="max_concurrency"):
        score(samples("a"), RewardConfig(name="numeric"), ["1"], max_concurrency=0)
