"""The RL loop end to end on a tiny random model: learning, resume, placements, bad input.

Everything is real: the built-in engine (in process, or ``noria serve`` as a child process), the
trainer backend, the weight sync, rewards loaded by import path (``tests/toy_rewards.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from noria.config import ConfigError, load_config
from noria.errors import NoriaError
from noria.launch.job import LocalJob
from noria.launch.rl import run_rl
from noria.rollout import EngineFailure
from repo_util import TESTS
from rl_util import mean, read_jsonl, rewards, rl_args


def test_reward_rises_then_resumed_leg_continues(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    config = load_config(None, rl_args(tiny_model_dir, **{"train.max_steps": 30, "train.save_every": 10}))
    run_rl(config, run_dir=str(run), progress=False)
    first = rewards(run)
    assert len(first) == 30
    assert mean(first[-5:]) > mean(first[:5]) + 0.15, first  # the policy learned to answer in digits
    # A second leg from the last checkpoint (step 30): the curve goes on from where it was.
    config = load_config(None, rl_args(tiny_model_dir, **{"train.max_steps": 40, "train.save_every": 10}))
    run_rl(config, resume=str(run), progress=False)
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert [r["version"] for r in rows] == list(range(1, 41))
    resumed = rewards(run)[30:]
    assert mean(resumed) > mean(first[:5]) + 0.15, resumed
    assert (run / "final" / "config.json").is_file()


def test_deterministic_run_reports_exact_agreement_at_step_0(tiny_model_dir, tmp_path):
    """Engine rollout logprobs (temperature 0.7) == the trainer's, bitwise, in deterministic mode."""
    run = tmp_path / "run"
    config = load_config(
        None, rl_args(tiny_model_dir, **{"train.max_steps": 2, "engine.deterministic": True, "rollout.temperature": 0.7})
    )
    run_rl(config, run_dir=str(run), progress=False)
    rows = read_jsonl(run / "metrics.jsonl")
    assert rows[0]["rollout_logprob_abs_diff_max"] == 0.0 and rows[0]["rollout_kl"] == 0.0
    assert rows[1]["rollout_logprob_abs_diff_max"] == 0.0  # still exact after a weight sync
    # The default (fast) mode reports the difference too: small, not zero by construction.
    run = tmp_path / "fast"
    run_rl(load_config(None, rl_args(tiny_model_dir, **{"train.max_steps": 1, "rollout.temperature": 0.7})), run_dir=str(run), progress=False)
    diff = read_jsonl(run / "metrics.jsonl")[0]["rollout_logprob_abs_diff_max"]
    assert 0.0 <= diff < 0.5


def test_config_and_data_errors_come_before_any_model_loads(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="batch invariant broken"):
        load_config(None, rl_args(tiny_model_dir, **{"train.global_batch": 16, "train.steps_per_rollout": 3}))
    with pytest.raises(ConfigError, match="asynchronous RL"):
        load_config(None, rl_args(tiny_model_dir, **{"rollout.max_staleness": 1}))
    config = load_config(None, rl_args(tiny_model_dir, **{"reward.name": "toy_rewards:no_such_fn"}))
    start = time.perf_counter()
    with pytest.raises(NoriaError, match="no_such_fn"):
        run_rl(config, run_dir=str(tmp_path / "bad"), progress=False)
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
    config = load_config(None, rl_args(tiny_model_dir, **{"data.task_args": "{n_train: 400, n_test: 16, max_operand: 2}"}))
    with pytest.raises(NoriaError, match="data.task_args"):
        run_rl(config, run_dir=str(tmp_path / "bad2"), progress=False)
    assert time.perf_counter() - start < 30


def test_batch_invariant_derives_the_fourth(tiny_model_dir):
    c = load_config(None, rl_args(tiny_model_dir, **{"train.global_batch": 16}))
    assert (c.rollout.prompts_per_step, c.rollout.n_samples, c.train.global_batch, c.train.steps_per_rollout) == (4, 8, 16, 2)
    c = load_config(None, rl_args(tiny_model_dir, **{"rollout.prompts_per_step": "null", "train.global_batch": 16, "train.steps_per_rollout": 2}))
    assert c.rollout.prompts_per_step == 4


def test_failed_rewards_are_counted_and_excluded(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    config = load_config(None, rl_args(tiny_model_dir, **{"reward.name": "toy_rewards:flaky", "train.max_steps": 3}))
    run_rl(config, run_dir=str(run), progress=False)
    rows = read_jsonl(run / "metrics.jsonl")
    failed = sum(r["reward/failed"] for r in rows)
    assert failed > 0
    for r in rows:  # trained samples = generated - failed (nothing else dropped here)
        assert r["train/samples"] == 32 - r["reward/failed"]


def test_two_optimizer_steps_per_rollout(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    config = load_config(None, rl_args(tiny_model_dir, **{"train.global_batch": 16, "train.max_steps": 2}))
    run_rl(config, run_dir=str(run), progress=False)
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["optimizer_step"] for r in rows] == [2.0, 4.0]
    assert all(r["approx_kl"] >= 0 for r in rows)


def test_evaluation_on_the_rollout_engine(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    config = load_config(None, rl_args(tiny_model_dir, **{"train.max_steps": 4, "eval.every": 2, "eval.max_new_tokens": 4}))
    run_rl(config, run_dir=str(run), progress=False)
    evals = read_jsonl(run / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 4]
    assert [e["version"] for e in evals] == [0, 2, 4]
    assert all(e["n_prompts"] == 16 and 0.0 <= e["accuracy"] <= 1.0 for e in evals)
    assert len(read_jsonl(run / "eval" / "step-000004.jsonl")) == 16


def test_disaggregated_engine_process(tiny_model_dir, tmp_path):
    """The engine as its own `noria serve` process; weights go over the broadcast transport."""
    run = tmp_path / "run"
    config = load_config(
        None, rl_args(tiny_model_dir, **{"rollout.placement": "disaggregated", "train.max_steps": 3, "sync.verify": True})
    )
    run_rl(config, run_dir=str(run), progress=False)
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert all(r["sync/seconds"] > 0 for r in rows)


def test_engine_process_that_dies_stops_the_run_naming_it(tiny_model_dir, tmp_path):
    config = load_config(None, rl_args(tiny_model_dir, **{"rollout.placement": "disaggregated", "train.max_steps": 3}))
    job = LocalJob.build(config, str(tmp_path / "run"), None, False)
    try:
        job.engine_process.kill()
        job.engine_process.wait()
        start = time.perf_counter()
        with pytest.raises(EngineFailure, match=r"engine at http://127\.0\.0\.1:\d+ .*exited with code"):
            import asyncio

            from noria.loop import rl_loop

            asyncio.run(job.run(rl_loop))
        assert time.perf_counter() - start < 30
    finally:
        job.close()


def _train_cmd(model: Path, run: Path, *extra: str) -> list[str]:
    config = run.parent / f"{run.name}.yaml"
    config.write_text("name: resume-test\n")
    args = rl_args(model, **{"train.max_steps": 4, "train.save_every": 1, "engine.deterministic": True})
    return [sys.executable, "-m", "noria", "train", str(config), *args, "--no-progress", *extra]


def test_sigkill_then_resume_is_bitwise_identical(tiny_model_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    straight = tmp_path / "straight"
    subprocess.run(_train_cmd(tiny_model_dir, straight, "--run-dir", str(straight)), check=True, env=env, timeout=300)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(_train_cmd(tiny_model_dir, killed, "--run-dir", str(killed)), env=env)
    marker = killed / "checkpoints" / "step-000002" / "COMMITTED"
    deadline = time.monotonic() + 240
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the run never committed its step-2 checkpoint"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    subprocess.run(_train_cmd(tiny_model_dir, killed, "--resume", str(killed)), check=True, env=env, timeout=300)

    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(killed / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for key in ("loss", "rollout/reward_mean", "grad_norm", "rollout_logprob_abs_diff_max"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    wa = load_file(straight / "final" / "model.safetensors")
    wb = load_file(killed / "final" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
