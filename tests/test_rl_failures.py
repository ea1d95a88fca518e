"""Runs that cannot train stop with an error that names the cause; none exits 0 (CPU, tiny model).

Everything is real: ``noria train`` through the CLI entry point, the built-in engine, rewards loaded
by import path (``tests/reward_plugins.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from noria.cli import main
from test_rl_loop import rl_args


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
