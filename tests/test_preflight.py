"""What a config names must exist before a run starts: `noria config` refuses what `noria train` would
refuse later, and a run that fails before its first step leaves no run folder behind (CPU, tiny model).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from noria.cli import main
from rl_util import rl_args

BASE = ["--model.path", "m", "--data.task", "arithmetic"]


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["--train.loss.advantage", "grp"], ["train.loss.advantage", "'grp'", "gae", "grpo", "rloo"]),
        (["--train.loss.policy_loss", "ppo"], ["train.loss.policy_loss", "'ppo'", "ppo_clip", "cispo"]),
        (["--reward.name", "numerik"], ["reward.name", "'numerik'", "numeric"]),
        (["--reward.name", "nowhere_module:fn"], ["reward.name", "cannot import 'nowhere_module'"]),
        (["--reward.name", "reward_plugins:no_such_fn"], ["reward.name", "has no 'no_such_fn'"]),
        (["--rollout.buffer.filters", "nowhere_module:keep"], ["rollout.buffer.filters", "nowhere_module"]),
        (["--rollout.generate_fn", "reward_plugins:length_at_least"], ["rollout.generate_fn", "async"]),
        (["--eval.every", "2", "--eval.mode", "checkpoint", "--eval.backend", "eval_plugins:BackendWithoutEvaluate"],
         ["eval.backend", "lacks evaluate"]),
        (["--data.task", "arithmetik"], ["data.task", "'arithmetik'", "arithmetic"]),
        (["--data.task_args", "{max_operands: 3}"], ["data.task", "max_operands", "max_operand"]),
        (["--data.task", "null", "--data.path", "no/such/prompts.jsonl", "--reward.name", "numeric"],
         ["data.path", "no/such/prompts.jsonl", "not found"]),
    ],
)  # fmt: skip
def test_config_refuses_what_train_would_refuse(overrides, words, capsys):
    assert main(["config", *BASE, *overrides]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for word in words:
        assert word in err, err


def test_config_accepts_gae_and_import_paths(capsys):
    overrides = ["--train.loss.advantage", "gae", "--reward.name", "reward_plugins:length_at_least"]
    assert main(["config", *BASE, *overrides]) == 0
    assert "advantage: gae" in capsys.readouterr().out


def _train(tmp_path: Path, model: Path, run: Path, **extra) -> int:
    config = tmp_path / "run.yaml"
    config.write_text("name: preflight\n")
    return main(["train", str(config), *rl_args(model, **extra), "--run-dir", str(run), "--no-progress"])


def test_a_run_that_fails_before_its_first_step_leaves_no_folder(tiny_model_dir, tmp_path, capsys):
    """A reward that always raises: the engine loads and rollout runs, but no step can be trained."""
    failing = {
        "reward.name": "reward_plugins:raises", "rollout.n_samples": 2, "train.max_steps": 2,
        "data.task_args": "{n_train: 8, n_test: 4, max_operand: 30, ops: ['+']}",
    }  # fmt: skip
    run = tmp_path / "run"
    assert _train(tmp_path, tiny_model_dir, run, **failing) != 0
    assert not run.exists()
    assert _train(tmp_path, tiny_model_dir, run, **failing) != 0  # the same --run-dir again: the same cause
    err = capsys.readouterr().err
    assert "already holds a run" not in err and err.count("checker crashed") >= 2, err


def test_a_folder_that_existed_is_kept(tiny_model_dir, tmp_path):
    run = tmp_path / "mine"
    run.mkdir()
    (run / "notes.txt").write_text("the user's own file")
    failing = {"reward.name": "reward_plugins:raises", "rollout.n_samples": 2, "train.max_steps": 1,
               "data.task_args": "{n_train: 4, n_test: 4, max_operand: 30, ops: ['+']}"}  # fmt: skip
    assert _train(tmp_path, tiny_model_dir, run, **failing) != 0
    assert (run / "notes.txt").read_text() == "the user's own file"
