"""docs/quickstart.md "Your own data": the command lines of its shell block, run as written by the
installed ``noria`` command from the repository root with no PYTHONPATH, plus the overrides that make
the run small (the tiny test model for SmolLM2, one step). The reward is read from
examples/own_data/reward.py through its file path, and every sample gets scored by it."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from repo_util import ROOT

SECTION = "## Your own data"


def recipe_lines() -> list[str]:
    """The ``noria ...`` lines of the section's ```bash blocks, as a user would paste them."""
    text = (ROOT / "docs" / "quickstart.md").read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start : end if end >= 0 else len(text)]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    lines = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line]


def test_the_section_holds_one_command_that_trains_the_example():
    assert recipe_lines() == ["noria train examples/own_data/grpo.yaml"]


def test_the_recipe_trains_with_the_reward_from_its_file(tiny_model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing on the path but the install
    env["NORIA_HOME"] = str(tmp_path / "home")
    noria = str(Path(sys.executable).parent / "noria")
    run = tmp_path / "run"
    small = ["--model.path", str(tiny_model_dir), "--train.max_steps", "1", "--rollout.max_new_tokens", "4",
             "--engine.kv_cache_tokens", "4096", "--run-dir", str(run), "--no-progress"]  # fmt: skip
    for line in recipe_lines():
        argv = shlex.split(line)
        assert argv[0] == "noria", line
        proc = subprocess.run([noria, *argv[1:], *small], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["reward"]["name"] == "examples/own_data/reward.py:capital"
    assert saved["data"]["path"] == "examples/own_data/prompts.jsonl" and saved["data"]["metadata_keys"] == ["answer"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    n = saved["rollout"]["n_samples"] * saved["rollout"]["prompts_per_step"]
    assert rows[0]["reward/scored"] == n and rows[0]["reward/failed"] == 0
