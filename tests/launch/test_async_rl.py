"""Asynchronous RL end to end (CPU, tiny random model, a real ``noria serve`` engine process).

The same ``rl_loop`` as synchronous RL, with ``rollout.max_staleness`` > 0. Latencies are made
random on purpose: rewards sleep (``toy_rewards:slow_digits``), and the job's own engine client and
trainer are wrapped to wait a random while around the real calls (spies, not mocks: the engine
still generates every token and the trainer still trains). Invariants checked on every trained group.
"""

from __future__ import annotations


import pytest

from noria.config import ConfigError, load_config
from noria.rollout.buffer import staleness_of
from rl_util import async_args, read_jsonl, run_spied


def check_invariants(trained, max_staleness, batch):
    ids = [g.group_id for _, groups in trained for g in groups]
    assert len(ids) == len(set(ids)), "a group was trained twice"
    for version, groups in trained:
        assert len(groups) == batch
        assert all(staleness_of(g, version) <= max_staleness for g in groups)
    return ids


def test_async_run_keeps_the_bounds_and_resumes_without_losing_buffered_groups(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    args = {"train.max_steps": 4, "train.save_every": 4, "rollout.buffer.filters": "[zero_reward_variance]"}
    trained, job = run_spied(load_config(None, async_args(tiny_model_dir, **args)), run)
    first = check_invariants(trained, 1, 4)
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and len(first) == 16  # consumed = configured total
    for r in rows:
        assert r["buffer/size"] <= r["buffer/capacity"] == 8
        assert r["buffer/staleness_max"] <= 1 and r["time/trainer_wait_s"] >= 0 and 0 <= r["engine/busy_frac"] <= 1
        assert "rollout/in_flight" in r and "buffer/waiting_staleness_max" in r
    # Every group that left the scheduler is accounted for: trained, waiting, or dropped by reason.
    buffered = {g.group_id for g in job.buffer.groups}
    dropped = sum(v for k, v in rows[-1].items() if k.startswith("buffer/dropped/"))
    assert job.buffer.put_total == len(first) + len(buffered)
    assert dropped == sum(job.buffer.dropped.values())
    # Resume to step 6: the groups waiting in the buffer at the checkpoint are trained, none twice.
    trained2, _ = run_spied(load_config(None, async_args(tiny_model_dir, **{**args, "train.max_steps": 6})), run, resume=str(run))
    second = check_invariants(trained2, 1, 4)
    assert not set(first) & set(second)
    assert buffered <= set(second), (buffered, second)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_in_place_updates_sample_granularity_and_a_small_buffer(tiny_model_dir, tmp_path):
    args = {"rollout.max_staleness": 2, "rollout.pause_mode": "in_place", "rollout.buffer.capacity_batches": 1,
            "rollout.max_in_flight": 12, "train.max_steps": 5, "rollout.buffer.on_drop": "return"}  # fmt: skip
    trained, job = run_spied(load_config(None, async_args(tiny_model_dir, **args)), tmp_path / "run")
    ids = check_invariants(trained, 2, 4)
    assert len(ids) == 20
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(r["buffer/size"] <= 4 and r["rollout/in_flight"] <= 12 for r in rows)
    assert [r["version"] for r in rows] == [1, 2, 3, 4, 5]


def test_async_needs_an_explicit_correction_and_a_disaggregated_engine(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"explicit off-policy correction in train.loss.off_policy: tis .* recompute"):
        load_config(None, async_args(tiny_model_dir, **{"train.loss.off_policy": "none"}))
    with pytest.raises(ConfigError, match="needs rollout.placement: disaggregated; a colocated engine pauses"):
        load_config(None, async_args(tiny_model_dir, **{"rollout.placement": "colocated"}))
    load_config(None, async_args(tiny_model_dir, **{"train.loss.off_policy": "recompute"}))
