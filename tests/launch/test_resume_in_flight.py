"""In-flight work kept across a resume (``rollout.resume_in_flight``): an asynchronous run SIGKILLed
20 times, at 20 fault points counted exactly (``noria.faults``, ``POINT=kill@N``: never a time
window), each time resumed in the same run folder, then run to its end.

Checked from the run's own records: every prompt of the data is trained exactly once over the 20
kills (none lost, none twice: groups in flight, groups waiting in the buffer and prompts handed back
all survive every kill), and every trajectory a checkpoint recorded in the middle of its generation
ends, trained, with the recorded tokens first, their logprobs and weight versions unchanged (so the
off-policy correction sees the versions that really sampled them).

Real processes: ``python -m noria train`` and a ``noria serve`` at ``rollout.engine_url`` that
outlives each killed trainer (as an engine of its own would, or SGLang's: the requests of a killed
trainer are aborted when its connections drop, and each resumed trainer pushes the checkpoint's
weights before any rollout), on CPU with the tiny random Llama, loopback only. Its own engine child
would cost each of the 21 starts 3.3 s more (AMD EPYC 2 cores); the SIGKILL of a run with its
engine child is tests/launch/test_chaos_run.py's. One chain for both tests (a module fixture),
marked ``chaos``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from engine_server_util import ServeProcess
from repo_util import TESTS
from rl_util import read_jsonl, rl_args

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

N_PROMPTS, PER_STEP = 64, 4  # 16 steps: more than the 20 kills below can ever complete
KILLS = [  # the fault point each run dies at; the most steps it can complete first is in the comment
    "checkpoint.committed=kill@1",  # 1: right after a checkpoint that recorded requests in flight
    "rollout.in_flight_continued=kill@1",  # <= 1: continuing a recorded request, nothing committed since
    "metrics.write=kill@1",  # 0: trained and pushed, the step's line not written
    "checkpoint.committed=kill@2",  # 2
    "rollout.in_flight_recorded=kill@1",  # 0: requests stopped and recorded, the checkpoint not written
    "checkpoint.partial_written=kill@1",  # 0: every file written but the commit marker
    "sync.disk_write=kill@2",  # 0: the step's weights half-written (the first write is the resume's push)
    "rollout.in_flight_continued=kill@1",  # <= 1
    "checkpoint.committed=kill@1",  # 1
    "metrics.write=kill@2",  # 1
    "rollout.in_flight_recorded=kill@2",  # 1
    "checkpoint.partial_written=kill@2",  # 1
    "rollout.in_flight_continued=kill@1",  # <= 1
    "sync.disk_write=kill@3",  # 1
    "metrics.write=kill@1",  # 0
    "rollout.in_flight_recorded=kill@1",  # 0
    "checkpoint.partial_written=kill@1",  # 0
    "checkpoint.committed=kill@1",  # 1
    "rollout.in_flight_continued=kill@1",  # <= 1
    "checkpoint.committed=kill@1",  # 1: 15 steps at most in all, of 16
]


def train(tmp_path: Path, model: Path, engine_url: str, faults: str, resume: bool) -> subprocess.CompletedProcess:
    """One ``noria train`` of the chain, to its end or its fault point; its stderr appended to a file."""
    run = tmp_path / "run"
    args = rl_args(model, **{
        "rollout.placement": "disaggregated", "rollout.engine_url": engine_url, "rollout.max_staleness": 2,
        "train.loss.off_policy": "tis", "rollout.n_samples": 4, "rollout.prompts_per_step": PER_STEP,
        "rollout.max_new_tokens": 64, "rollout.buffer.on_drop": "return", "sync.transport": "disk", "train.save_every": 1,
    })  # fmt: skip
    task = args.index("--data.task")
    args[task : task + 4] = ["--data.path", str(tmp_path / "prompts.jsonl"), "--data.epochs", "1"]  # its task_args too
    where = ["--resume", str(run)] if resume else ["--run-dir", str(run)]
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "NORIA_FAULTS": faults}
    cmd = [sys.executable, "-m", "noria", "train", str(tmp_path / "chain.yaml"), *args, *where, "--no-progress"]
    with (tmp_path / "train.err").open("ab") as err:
        err.write(f"\n===== {faults or 'to the end'} =====\n".encode())
        err.flush()
        return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, timeout=300)


def latest_checkpoint(run: Path) -> tuple[int, dict]:
    found = sorted(p for p in (run / "checkpoints").glob("step-*") if (p / "COMMITTED").exists())
    if not found:
        return 0, {}
    return int(found[-1].name.split("-")[1]), json.loads((found[-1] / "trainer_state.json").read_text())["extra"]


@pytest.fixture(scope="module")
def chain(tiny_model_dir, tmp_path_factory):
    """The run killed at each of ``KILLS`` in turn and resumed, then to its end: (run folder, the
    in-flight record of every checkpoint a run resumed from, the folder of the chain, the groups
    waiting in the buffer at each of those checkpoints)."""
    tmp = tmp_path_factory.mktemp("chain")
    (tmp / "chain.yaml").write_text("name: resume-in-flight\n")
    with (tmp / "prompts.jsonl").open("w") as f:
        for i in range(N_PROMPTS):
            f.write(json.dumps({"prompt": f"Question {i}: what is {i} plus one?", "label": str(i + 1)}) + "\n")
    records, buffered, seconds = {}, {}, []
    engine = ServeProcess(tiny_model_dir, log_dir=tmp).wait_ready()
    try:
        for i, fault in enumerate([*KILLS, ""]):
            start = time.monotonic()
            done = train(tmp, tiny_model_dir, engine.url, fault, resume=i > 0)
            seconds.append(time.monotonic() - start)
            err = (tmp / "train.err").read_text(errors="replace")[-4000:]
            if fault:
                assert done.returncode == -9, f"run {i + 1} ({fault}) ended {done.returncode}, not at its fault point: {err}"
            else:
                assert done.returncode == 0, err
            step, extra = latest_checkpoint(tmp / "run")
            if extra:
                records[step] = extra.get("in_flight", {"groups": []})  # none before in-flight records existed
                buffered[step] = len(extra["buffer"]["groups"])
    finally:
        assert engine.stop() == 0, engine.read_log()
    print(f"chain: {len(seconds)} runs, {sum(seconds):.1f} s: " + " ".join(f"{s:.1f}" for s in seconds))
    print(f"groups buffered at each checkpoint resumed from: {buffered}")
    return tmp / "run", records, tmp, buffered


def trained_samples(run: Path) -> list[dict]:
    return [row for path in sorted((run / "rollouts").glob("step-*.jsonl")) for row in read_jsonl(path)]


def test_twenty_sigkills_of_an_async_run_train_every_prompt_exactly_once(chain):
    """The prompts of the trained groups, over the whole run: each of the data's prompts exactly once."""
    run, records, tmp, buffered = chain
    assert any(buffered.values()), "no checkpoint resumed from held buffered groups: the check below would not cover them"
    steps = [row["step"] for row in read_jsonl(run / "metrics.jsonl")]
    assert steps == list(range(1, N_PROMPTS // PER_STEP + 1))
    prompt_of = {row["group_id"]: row["prompt"] for row in trained_samples(run)}
    counts = Counter(prompt_of.values())
    twice = sorted(p for p, n in counts.items() if n > 1)
    assert not twice, f"trained more than once: {twice}"
    data = [json.loads(line)["prompt"] for line in (tmp / "prompts.jsonl").read_text().splitlines()]
    lost = sorted(set(data) - set(counts))
    assert not lost, f"never trained: {lost}"
    assert sorted(counts) == sorted(data)
    resumed = sum("in flight at the checkpoint" in line for line in (tmp / "train.err").read_text().splitlines())
    assert resumed == len(KILLS), "every resume says what it did with the checkpoint's in-flight groups"


def test_continued_requests_keep_their_recorded_tokens_logprobs_and_versions(chain):
    """Each trajectory a checkpoint recorded mid-generation ends, trained, with exactly the recorded
    tokens first, with their logprobs and weight versions (a stale group may have been retracted or
    dropped instead: its prompt was then trained under another group, as the test above shows)."""
    run, records, _, _ = chain
    final = {(row["group_id"], row["index"]): row for row in trained_samples(run)}
    recorded = [
        (g["group_id"], s) for record in records.values() for g in record["groups"]
        for s in g["samples"] if s["status"] == "pending" and s["response_ids"]
    ]  # fmt: skip
    assert recorded, "no checkpoint recorded a trajectory in the middle of its generation"
    checked = 0
    for group_id, s in recorded:
        row = final.get((group_id, s["index"]))
        if row is None:
            continue
        n = len(s["response_ids"])
        assert row["token_ids"][:n] == s["response_ids"], (group_id, s["index"])
        assert row["logprobs"][:n] == s["rollout_logprobs"], (group_id, s["index"])
        assert row["weight_versions"][:n] == s["weight_versions"], (group_id, s["index"])
        assert len(row["token_ids"]) > n or row["status"] in ("completed", "truncated")
        checked += 1
    assert checked >= len(recorded) // 2, f"only {checked} of {len(recorded)} recorded trajectories were trained"
