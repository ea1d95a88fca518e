"""`noria train --resume RUN`: without a config file the run's own config.yaml is used (overrides on top);
with one, every key that differs is named (CPU, tiny model, the real CLI entry point)."""

from __future__ import annotations

import json

from noria.cli import main
from rl_util import rl_args


def _steps(run) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_resume_without_a_config_uses_the_runs_own(tiny_model_dir, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("name: resume-cli\n")
    run = tmp_path / "run"
    extra = {"train.max_steps": 2, "train.save_every": 2, "rollout.temperature": 0.9, "rollout.n_samples": 4}
    args = rl_args(tiny_model_dir, **extra)
    assert main(["train", str(config), *args, "--run-dir", str(run), "--no-progress"]) == 0
    # No config file and none of the overrides retyped: only the extension.
    assert main(["train", "--resume", str(run), "--train.max_steps", "3", "--no-progress"]) == 0
    assert _steps(run) == [1, 2, 3]

    # With the config file but without the overrides: every difference is named, not the first five.
    code = main(["train", str(config), "--model.path", str(tiny_model_dir), "--data.task", "arithmetic",
                 "--resume", str(run), "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "the config differs from the run's config.yaml" in err, err
    for key in ("rollout.temperature: 0.9 -> 1.0", "rollout.n_samples: 4 -> 8", "reward.name", "train.optim.lr",
                "rollout.max_new_tokens", "engine.kv_cache_tokens", "data.task_args"):
        assert key in err, (key, err)
    assert _steps(run) == [1, 2, 3]


def test_train_without_config_or_resume_says_what_it_needs(capsys):
    assert main(["train", "--no-progress"]) == 2
    assert "needs a CONFIG file, or --resume RUN_DIR" in capsys.readouterr().err
