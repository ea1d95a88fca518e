"""A disk that fills up or turns read-only under a run: the run stops naming the file and the space
left, nothing half-written is trusted, and the last committed checkpoint resumes the run.

The faults are Noria's own fault points (``noria.faults``: the write raises ``OSError(ENOSPC)`` at a
named place, exactly as a full disk would there), armed in this process for the in-process runs;
the read-only folder is a real read-only bind mount in a mount namespace of its own (root only, as
in CI). CPU, tiny random model, loopback only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from repo_util import ROOT, TESTS
from rl_util import read_jsonl, rl_args

from noria import faults
from noria.config import load_config
from noria.errors import DiskError
from noria.launch.rl import run_rl
from noria.sync import WeightSyncError

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def armed(monkeypatch):
    """``armed(spec)``: arm fault points in this process for the next run (disarmed after the test)."""

    def arm(spec: str) -> None:
        monkeypatch.setattr(faults, "_armed", faults.parse(spec))
        monkeypatch.setattr(faults, "_reached", faults.Counter())

    yield arm
    faults._armed = None


def config(model: Path, **extra):
    return load_config(None, rl_args(model, **{"train.max_steps": 3, "train.save_every": 1, **extra}))


def resume_to_the_end(model: Path, run: Path, **extra) -> None:
    faults._armed = {}
    run_rl(config(model, **extra), resume=str(run), progress=False)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]


def test_a_full_disk_during_a_checkpoint_keeps_the_last_committed_one(tiny_model_dir, tmp_path, armed):
    run = tmp_path / "run"
    armed("checkpoint.partial_written=raise:ENOSPC@2")
    with pytest.raises(DiskError) as caught:
        run_rl(config(tiny_model_dir), run_dir=str(run), progress=False)
    said = str(caught.value)
    assert ".step-000002.partial" in said and "No space left on device" in said and "MiB free" in said, said
    assert "step-000001, is intact" in said and f"--resume {run}" in said, said
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001"]  # the partial one is gone
    resume_to_the_end(tiny_model_dir, run)


def test_a_full_disk_during_a_metrics_write_stops_naming_the_file(tiny_model_dir, tmp_path, armed):
    run = tmp_path / "run"
    armed("metrics.write=raise:ENOSPC@2")
    with pytest.raises(DiskError, match=r"the run log \(step 2\): could not write .*metrics\.jsonl: No space left on device .*MiB free"):
        run_rl(config(tiny_model_dir), run_dir=str(run), progress=False)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1]
    resume_to_the_end(tiny_model_dir, run)


def test_a_full_disk_during_a_weight_push_keeps_the_served_version(tiny_model_dir, tmp_path, armed):
    run = tmp_path / "run"
    extra = {"rollout.placement": "disaggregated", "sync.transport": "disk"}
    armed("sync.disk_write=raise:ENOSPC@2")
    with pytest.raises(WeightSyncError, match=r"the weight push of version 2: could not write .*\.v00000002\.partial-\w+: No space left"):
        run_rl(config(tiny_model_dir, **extra), run_dir=str(run), progress=False)
    assert not list((run / "weights").glob(".*partial*")) and not (run / "weights" / "v00000002").exists()
    resume_to_the_end(tiny_model_dir, run, **extra)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="a read-only bind mount needs root (CI runs as root)")
def test_a_read_only_run_folder_is_refused_before_any_model_loads(tiny_model_dir, tmp_path):
    """Resuming a run whose folder became read-only: one line naming the folder, within seconds."""
    run, config_file = tmp_path / "run", tmp_path / "ro.yaml"
    config_file.write_text("name: read-only\n")
    noria = [sys.executable, "-m", "noria", "train", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    first = subprocess.run([*noria, str(config_file), *rl_args(tiny_model_dir, **{"train.max_steps": 1}), "--run-dir", str(run)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert first.returncode == 0, first.stderr
    assert (run.stat().st_mode & 0o777) == 0o700 and (run / "metrics.jsonl").stat().st_mode & 0o077 == 0  # owner only
    remount = f'mount --bind "{run}" "{run}" && mount -o remount,ro,bind "{run}" && exec "$@"'
    resumed = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", remount, "sh", *noria, "--resume", str(run)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert resumed.returncode != 0 and f"run folder {run} is on a read-only file system" in resumed.stderr, resumed.stderr
    assert "loading the trainer" not in resumed.stderr  # refused before any model loads
