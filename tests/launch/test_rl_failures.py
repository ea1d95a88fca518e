"""Runs that cannot train stop with an error that names the cause; none exits 0 (CPU, tiny model).

Everything is real: ``noria train`` through the CLI entry point, the built-in engine, rewards loaded
by import path (``tests/reward_plugins.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from noria.cli import main
from rl_util import rl_args


def train(tmp_path: Path, model: Path, **extra) -> int:
    config = tmp_path / "run.yaml"
    config.write_text("name: failures\n")
    return main(["train", str(config), *rl_args(model, **extra), "--run-dir", str(tmp_path / "run"), "--no-progress"])


@pytest.mark.parametrize(
    ("on_drop", "max_drops", "cause"),
    [
        ("discard", 64, "the data ran out before one group could be trained: 12 groups"),  # used to export the base model, exit 0
        ("return", 6, "no group could be trained: 6 groups dropped in a row"),  # used to loop forever
    ],
)
def test_reward_that_always_fails_stops_the_run_naming_it(tiny_model_dir, tmp_path, capsys, on_drop, max_drops, cause):
    code = train(
        tmp_path, tiny_model_dir, **{
            "reward.name": "reward_plugins:raises", "rollout.buffer.on_drop": on_drop, "rollout.n_samples": 2,
            "rollout.buffer.max_consecutive_drops": max_drops, "train.max_steps": 3,
            "data.task_args": "{n_train: 12, n_test: 4, max_operand: 30, ops: ['+']}",
        },
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0
    assert cause in err and "no_trainable_sample" in err and "raised RuntimeError: checker crashed" in err, err
    assert not (tmp_path / "run" / "final").exists()


def test_filter_that_keeps_nothing_stops_the_run_naming_it(tiny_model_dir, tmp_path, capsys):
    code = train(
        tmp_path, tiny_model_dir, **{
            "reward.name": "reward_plugins:length_at_least", "rollout.buffer.filters": "[zero_reward_variance]",
            "rollout.buffer.max_consecutive_drops": 5, "rollout.buffer.on_drop": "return", "rollout.n_samples": 2,
        },
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and "5 groups dropped in a row (zero_reward_variance: 5)" in err, err


def test_run_engine_takes_weights_only_from_the_run(tiny_model_dir, tmp_path):
    """The run's `noria serve` has a per-run key (not on its command line); a version the run never
    pushed stops the run instead of being trained on."""
    import asyncio

    import httpx

    from noria.config import load_config
    from noria.launch.job import LocalJob
    from noria.loop import rl_loop
    from noria.rollout import EngineFailure

    config = load_config(None, rl_args(tiny_model_dir, **{"rollout.placement": "disaggregated", "train.max_steps": 3}))
    job = LocalJob.build(config, str(tmp_path / "run"), None, False)
    try:
        url, pid = job.client.base_url, job.engine_process.pid
        update = {"model_path": str(tiny_model_dir), "weight_version": 0}
        assert httpx.post(f"{url}/update_weights_from_disk", json=update, timeout=60).status_code == 401
        assert httpx.get(f"{url}/get_weight_version").status_code == 401
        environ = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
        key = environ["NORIA_API_KEY"]
        assert len(key) >= 32 and key not in Path(f"/proc/{pid}/cmdline").read_text()
        # Whoever holds the key and pushes a version the run never pushed: the run stops, naming it.
        auth = {"Authorization": f"Bearer {key}"}
        r = httpx.post(f"{url}/update_weights_from_disk", json={**update, "weight_version": 7}, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        with pytest.raises(EngineFailure, match="weight version 7.*pushed versions up to 0"):
            asyncio.run(job.run(rl_loop))
    finally:
        job.close()


def test_prompt_longer_than_the_context_is_refused_at_load(tiny_model_dir, tmp_path, capsys):
    """It used to fail only at rollout time, many steps in, naming no file or row."""
    import json

    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"What is {i} + {i}?", "label": str(2 * i)} for i in range(8)]
    rows[5]["prompt"] = "What is 1 + 1? " * 200  # far past the tiny model's 512 positions
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = {"data.task": "null", "data.path": str(data), "data.metadata_keys": "[]", "rollout.prompts_per_step": 2}
    code = train(tmp_path, tiny_model_dir, **overrides)
    err = capsys.readouterr().err
    assert code == 2 and str(data) in err and "row index 5" in err and "data.max_prompt_tokens" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
