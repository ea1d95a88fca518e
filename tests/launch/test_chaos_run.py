"""Chaos on a whole run: real signals to a real ``noria train`` and to its ``noria serve`` child.

Each test pins its victim and asserts what must hold: the run stops within a bound (never hangs),
with an exit code and a message that name the cause, leaves no process behind, and its logs are
whole; a run stopped this way resumes from its last committed checkpoint with no group trained twice.

CPU, tiny random model, loopback only; marked ``chaos`` (each runs one or two short trainings).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proc_util import alive, descendants, wait_gone
from repo_util import TESTS
from rl_util import rl_args

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(420)]


class Train:
    """``python -m noria train`` as a child process, its stderr in a file."""

    def __init__(self, tmp_path: Path, model: Path, *extra: str, resume: bool = False, faults: str = "", **overrides) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.run = tmp_path / "run"
        config = tmp_path / "chaos.yaml"
        config.write_text("name: chaos\n")
        args = rl_args(model, **{"train.max_steps": 40, **overrides})
        where = ["--resume", str(self.run)] if resume else ["--run-dir", str(self.run)]
        self.err_path = tmp_path / ("resume.err" if resume else "train.err")
        env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "NORIA_FAULTS": faults}
        cmd = [sys.executable, "-m", "noria", "train", str(config), *args, *where, "--no-progress", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.err_path, "wb"), env=env)  # noqa: SIM115

    def steps(self) -> list[dict]:
        path = self.run / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_steps(self, n: int, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.steps()) < n:
            assert self.proc.poll() is None, f"the run exited early ({self.proc.returncode}): {self.stderr()}"
            assert time.monotonic() < deadline, f"no step {n} within {timeout_s} s: {self.stderr()}"
            time.sleep(0.1)

    def kill_when_stopped(self, timeout_s: float) -> None:
        """Wait until the run stops itself at its armed fault point (state T), then SIGKILL it there."""
        deadline = time.monotonic() + timeout_s
        while not stopped(self.proc.pid):
            assert self.proc.poll() is None, f"the run exited ({self.proc.returncode}) before its fault point: {self.stderr()}"
            assert time.monotonic() < deadline, f"the run did not reach its fault point within {timeout_s} s: {self.stderr()}"
            time.sleep(0.05)
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def engine_pid(self) -> int:
        found = [p for p in descendants(self.proc.pid) if b"serve" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(found) == 1, found
        return found[0]

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"the run did not stop within {timeout_s} s (a hang): {self.stderr()}")

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")[-3000:]


def stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal (state T in /proc/PID/stat)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def disaggregated(**extra) -> dict:
    return {"rollout.placement": "disaggregated", **extra}


def trained_group_ids(run: Path) -> list[int]:
    """Every group id in the run's per-step rollout files, in step order (one entry per trained group)."""
    ids = []
    for path in sorted((run / "rollouts").glob("step-*.jsonl")):
        ids += sorted({json.loads(line)["group_id"] for line in path.read_text().splitlines()})
    return ids


# ------------------------------------------------------------------------------ signals to noria train


@pytest.mark.parametrize(
    ("placement", "sig", "code", "said"),
    [("disaggregated", signal.SIGTERM, 143, "SIGTERM"), ("colocated", signal.SIGTERM, 143, "SIGTERM"),
     ("disaggregated", signal.SIGINT, 130, "Ctrl-C")],
    ids=["sigterm-disaggregated", "sigterm-colocated", "ctrl-c-disaggregated"],
)  # fmt: skip
def test_sigterm_stops_the_run_like_ctrl_c(tiny_model_dir, tmp_path, placement, sig, code, said):
    """128 + the signal, a message saying how to resume, whole metric lines, the engine child stopped."""
    run = Train(tmp_path, tiny_model_dir, **{"rollout.placement": placement, "train.save_every": 1})
    run.wait_steps(2)
    children = descendants(run.proc.pid)
    run.proc.send_signal(sig)
    assert run.wait(90) == code, run.stderr()
    err = run.stderr()
    assert said in err and "--resume" in err, err
    assert all(isinstance(row["step"], int) for row in run.steps())  # every line whole JSON
    assert wait_gone(children, 10) == [], "children left behind"


def test_sigterm_inside_the_colocated_trainers_turn(tiny_model_dir, tmp_path):
    """A signal while the colocated engine has released its weights for the trainer's step stops the run
    as any SIGTERM does (143, how to resume): the engine's resume, which needs a weight update that
    never came, no longer raises over it (it ended the run with exit 2 and a resume error)."""
    run = Train(tmp_path, tiny_model_dir, faults="train.step=stop@3", **{"rollout.placement": "colocated", "train.save_every": 1})
    deadline = time.monotonic() + 180
    while not stopped(run.proc.pid):  # the third step's trainer turn: the engine paused, its weights freed
        assert run.proc.poll() is None and time.monotonic() < deadline, run.stderr()
        time.sleep(0.05)
    run.proc.send_signal(signal.SIGTERM)
    run.proc.send_signal(signal.SIGCONT)
    assert run.wait(90) == 143, run.stderr()
    err = run.stderr()
    assert "SIGTERM" in err and "--resume" in err and "resume_memory_occupation" not in err, err


def test_sigkill_of_train_takes_its_engine_along(tiny_model_dir, tmp_path):
    """The `noria serve` child used to be reparented to init and keep listening with its memory."""
    run = Train(tmp_path, tiny_model_dir, **disaggregated())
    run.wait_steps(1)
    engine = run.engine_pid()
    run.proc.send_signal(signal.SIGKILL)
    run.proc.wait()
    assert wait_gone([engine], 10) == [], "the engine outlived its run"


# ------------------------------------------------------------------------------ signals to the engine


@pytest.mark.parametrize("staleness", [0, 1], ids=["sync", "async"])
def test_engine_sigkill_mid_run_stops_it_naming_the_engine_then_resume_trains_no_group_twice(tiny_model_dir, tmp_path, staleness):
    extra = disaggregated(**{"rollout.max_staleness": staleness, "train.save_every": 1, "train.max_steps": 6})
    if staleness:
        extra["train.loss.off_policy"] = "tis"
    run = Train(tmp_path, tiny_model_dir, **extra)
    run.wait_steps(2)
    engine = run.engine_pid()
    os.kill(engine, signal.SIGKILL)  # while serving: the next step's rollouts are in flight
    start = time.monotonic()
    code = run.wait(60)
    assert code not in (0, None) and time.monotonic() - start < 60
    err = run.stderr()
    assert "engine at http://127.0.0.1:" in err and "exited with code -9" in err, err
    done = len(run.steps())
    resumed = Train(tmp_path, tiny_model_dir, resume=True, **extra)
    assert resumed.wait(240) == 0, resumed.stderr()
    assert [row["step"] for row in resumed.steps()] == list(range(1, 7)) and done >= 2
    ids = trained_group_ids(run.run)
    assert len(ids) == len(set(ids)), f"a group was trained twice: {ids}"
    if staleness == 0:
        assert ids == list(range(len(ids))), f"a group was lost: {ids}"  # synchronous: ids in order, none skipped


def test_engine_sigstop_past_the_deadline_is_detected(tiny_model_dir, tmp_path):
    """A stopped (not dead) engine answers nothing; the run stops within rollout.engine_timeout_s."""
    run = Train(tmp_path, tiny_model_dir, **disaggregated(**{"rollout.engine_timeout_s": 5}))
    run.wait_steps(1)
    engine = run.engine_pid()
    os.kill(engine, signal.SIGSTOP)
    try:
        start = time.monotonic()
        code = run.wait(60)
        assert code not in (0, None) and time.monotonic() - start < 40, run.stderr()
        assert "engine at http://127.0.0.1:" in run.stderr() and "engine_timeout_s" in run.stderr(), run.stderr()
    finally:
        if alive(engine):
            os.kill(engine, signal.SIGCONT)
    assert wait_gone([engine], 15) == []


# ------------------------------------------------------------------------------ SIGKILL of the trainer


def final_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run / "final" / "model.safetensors")


def test_sigkill_mid_checkpoint_save_then_resume_is_bitwise_identical(tiny_model_dir, tmp_path):
    """Killed while a checkpoint is being written (its hidden partial folder holds every file but the
    commit marker): the resumed run continues from the last committed one and ends bitwise equal to
    an uninterrupted run. The run stops itself at that point (fault point
    ``checkpoint.partial_written``, the second save), so the kill lands inside the save every time."""
    import torch

    extra = {"train.max_steps": 4, "train.save_every": 1, "engine.deterministic": True}
    straight = Train(tmp_path / "a", tiny_model_dir, **extra)
    assert straight.wait(240) == 0, straight.stderr()
    folder = tmp_path / "b"
    run = Train(folder, tiny_model_dir, faults="checkpoint.partial_written=stop@2", **extra)
    run.kill_when_stopped(240)
    checkpoints = run.run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [".step-000002.partial", "step-000001"]
    assert (checkpoints / ".step-000002.partial" / "trainer_state.json").exists()  # written, not committed
    resumed = Train(folder, tiny_model_dir, resume=True, **extra)
    assert resumed.wait(240) == 0, resumed.stderr()
    a, b = straight.steps(), resumed.steps()
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for key in ("loss", "rollout/reward_mean", "grad_norm"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    wa, wb = final_weights(straight.run), final_weights(resumed.run)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_sigkill_of_async_run_with_a_full_buffer_resumes_its_buffered_groups(tiny_model_dir, tmp_path):
    """Asynchronous RL, groups waiting in the buffer when killed: the resumed run trains the
    checkpoint's buffered groups, never one twice, and reaches the configured step count. The
    buffer (``ReserveBuffer``) always keeps a group back, and the run stops itself right after
    step 2's checkpoint is committed (fault point ``checkpoint.committed``): no timing involved.

    ``max_staleness`` is 3, not 2: the buffer is FIFO by completion, so a group started at version 0
    that finished after a version-1 group can reach step 4 (trainer version 3), where at 2 it is
    rightly dropped as stale; this test once read that as a lost group. The checkpoint's groups are
    all taken by step 4 (they are older than any the resumed run makes), so at 3 none is dropped.
    Other groups may be: a request in flight at the checkpoint continues with its version-0 tokens."""
    extra = disaggregated(**{
        "rollout.max_staleness": 3, "train.loss.off_policy": "tis", "rollout.buffer.capacity_batches": 2,
        "rollout.buffer.impl": "buffer_plugins:ReserveBuffer", "train.save_every": 1, "train.max_steps": 5,
    })  # fmt: skip
    folder = tmp_path / "a"
    run = Train(folder, tiny_model_dir, faults="checkpoint.committed=stop@2", **extra)
    run.kill_when_stopped(240)
    state = json.loads((run.run / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    buffered = {g["group_id"] for g in state["extra"]["buffer"]["groups"]}
    assert buffered, "the reserve buffer held no group at the checkpoint"
    resumed = Train(folder, tiny_model_dir, resume=True, **extra)
    assert resumed.wait(240) == 0, resumed.stderr()
    assert [r["step"] for r in resumed.steps()] == [1, 2, 3, 4, 5]
    ids = trained_group_ids(run.run)
    assert len(ids) == len(set(ids)), f"a group was trained twice: {ids}"
    assert buffered <= set(ids), f"a group buffered at the checkpoint was lost: {sorted(buffered - set(ids))} of {sorted(buffered)}"
