"""One tiny real RL run shared by the run-experience tests (metrics, report, inspect).

Built at most once per pytest session, under the session's base temp folder: a tiny random Llama
(``tiny_model_dir``), 3 rollout steps with evaluation every 2 steps, all three metric sinks on
(JSONL, TensorBoard, W&B offline with its server address pointed at a closed loopback port, so any
network use would fail).
"""

from __future__ import annotations

import os
from pathlib import Path

STEPS = 3


def tiny_run(tmp_path_factory, model: Path) -> Path:
    run = tmp_path_factory.getbasetemp() / "runview-tiny-run"
    if (run / "final").is_dir():
        return run
    from noria.config import load_config
    from noria.launch.rl import run_rl

    os.environ["WANDB_BASE_URL"] = "http://127.0.0.1:9"  # discard port: nothing listens
    os.environ["WANDB_MODE"] = "offline"
    args = {
        "model.path": str(model),
        "data.task": "arithmetic",
        "data.task_args": "{n_train: 64, n_test: 4, max_operand: 30, ops: ['+']}",
        "reward.name": "toy_rewards:digits",
        "rollout.n_samples": 4,
        "rollout.prompts_per_step": 2,
        "rollout.max_new_tokens": 6,
        "engine.kv_cache_tokens": 2048,
        "train.max_steps": STEPS,
        "eval.every": 2,
        "eval.max_new_tokens": 4,
        "log.loggers": "[jsonl, tensorboard, wandb]",
    }
    overrides = [x for k, v in args.items() for x in (f"--{k}", str(v))]
    run_rl(load_config(None, overrides), run_dir=str(run), progress=False)
    return run
