"""Evaluation backends for tests, loaded through the real plug point ``eval.backend`` (``eval.mode:
checkpoint``): one that meets the contract (tests/eval/test_eval_modes.py runs it beside training),
one that breaks it (tests/test_plugin_contracts.py, tests/test_preflight.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from noria.eval.snapshot import MARKER
from rl_util import read_jsonl


class SlowFlakyBackend:
    """A checkpoint backend (``eval.backend``) that checks its folder, answers digits, waits for
    training to go on, and fails at step 4."""

    def __init__(self, config):
        self.config = config

    def evaluate(self, request):
        assert (request.folder / MARKER).read_text().strip() == str(request.step)
        assert json.loads((request.folder / "config.json").read_text())["model_type"] == "llama"
        if request.step == 4:
            raise RuntimeError("backend down at step 4")
        if request.step == 0:  # training goes on; the evaluation due at step 2 finds this one in flight
            wait_for(lambda: any(r.get("step") == 2 for r in read_jsonl_safe(request.run_dir / "eval.jsonl")))
        return [["42"] * request.n_samples for _ in request.prompts]


def read_jsonl_safe(path: Path) -> list[dict]:
    return read_jsonl(path) if path.exists() else []


def wait_for(condition, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "training did not go on while the backend evaluated"
        time.sleep(0.02)


class BackendWithoutEvaluate:
    def __init__(self, config):
        pass

    def run(self, request):
        return []
