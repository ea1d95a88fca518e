"""Elastic engine fleets: a running job grows from 1 to 3 engines and shrinks to 1, through
``noria fleet add|remove`` run as a user runs it and through SIGTERM of an engine (preemption).
Every group is trained exactly once (the run's own records), every engine's weights are checked
against the trainer's by checksum, and the engine that left on SIGTERM is neither a failure nor a
restart. CPU, tiny random model, real ``noria serve`` processes and the real sglang-router on
127.0.0.1; the test waits on the files the run and the command write, never on a time window."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from noria.config import load_config
from noria.errors import NoriaError
from noria.launch import elastic
from noria.launch.scaled import ScaledJob
from noria.loop import rl_loop
from rl_util import check_nothing_lost, fleet_args, read_jsonl, steps

pytestmark = pytest.mark.router
WAIT_S = 120.0
"""Bound of every wait below (each ends on an event long before it on a working fleet)."""


def noria_fleet(*args: str) -> subprocess.Popen:
    """``noria fleet ...`` as a user types it, in its own process."""
    return subprocess.Popen([sys.executable, "-m", "noria", "fleet", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(what: str, check, proc: subprocess.Popen | None = None):
    """Until ``check()`` gives something true (a file the run or the command wrote); fails naming ``what``."""
    deadline = time.monotonic() + WAIT_S
    while not (found := check()):
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: noria fleet exited {proc.returncode} first: {proc.communicate()}")
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S} s"
        time.sleep(0.01)
    return found


def finished(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, (out, err)
    return out


def events(run: Path) -> list[dict]:
    path = run / "fleet" / "events.jsonl"
    return read_jsonl(path) if path.exists() else []


def check_weights(job, slots) -> None:
    """Every engine of ``slots`` serves the run's version with the trainer's bytes: its checksums
    against the trainer's tensors (the check a verified push makes; here through a sync that only
    reads checksums)."""
    from noria.sync import HttpEngine, build_sync

    cfg = dataclasses.replace(job.config.sync, transport="disk", verify=True)
    sync = build_sync(cfg, [HttpEngine(s.proc.url, api_key=job.api_key) for s in slots], run_dir=job.folder / "check")
    try:
        backend = job.ranks.rank.backend
        sync.verify_tensors(backend._full_tensors(backend.compute_dtype), job.weight_version)  # raises on any mismatch
    finally:
        sync.close()


def routed(job) -> set[str]:
    return {w["url"].rstrip("/") for w in job.fleet.router.workers()}


def test_a_running_fleet_grows_to_three_engines_and_shrinks_to_one_training_every_group_once(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # each engine process on one thread: two cores for three engines
    run = tmp_path / "run"
    # engine_drain_s 0: an engine leaving aborts what it has in flight, so those requests are moved; two
    # requests decoded at once, so that an engine has requests queued (far from done) when it is preempted
    extra = {"rollout.elastic": True, "rollout.engine_drain_s": 0, "engine.max_running_requests": 2, "train.max_steps": 6}
    stale = run / "fleet" / "requests" / "0-stale.json"  # left by an earlier job: refused, never acted on
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"action": "add", "n": 5}))
    job = ScaledJob.build(load_config(None, fleet_args(tiny_model_dir, **extra)), str(run), None, False)
    assert len(job.fleet.slots) == 1 and job.fleet.router is None
    assert not stale.exists() and "refused" in json.loads((run / "fleet" / "answers" / "0-stale.json").read_text())["message"]
    commands: dict[str, subprocess.Popen] = {}
    preempted: dict[str, float] = {}
    real_train, real_generate = job.train, job.client.generate
    requests = run / "fleet" / "requests"

    def train(groups):
        step = job.step + 1
        if step == 1:  # grow: the job takes the request at its next safe point (step 2's wait for groups)
            commands["add"] = noria_fleet("add", str(run), "--n", "2")
            wait_for("the add request", lambda: list(requests.glob("*.json")), commands["add"])
        if step == 2:
            assert "added 2 of 2" in finished(commands["add"])
            serving = job.fleet.serving()
            assert [s.index for s in serving] == [0, 1, 2] and routed(job) == {s.proc.url for s in serving}
            check_weights(job, serving)
            status = subprocess.run([sys.executable, "-m", "noria", "fleet", "status", str(run)], capture_output=True, text=True, check=True)
            assert [line.split()[2] for line in status.stdout.splitlines()] == ["serving"] * 3, status.stdout
            commands["remove"] = noria_fleet("remove", str(run), "1")
            wait_for("the remove request", lambda: list(requests.glob("*.json")), commands["remove"])
        if step == 3:
            assert "engine 1 at" in finished(commands["remove"]) and routed(job) == {job.fleet.slots[0].proc.url, job.fleet.slots[2].proc.url}
        if step == 5:  # the engine preempted during step 4's rollout is gone (the run's record says so)
            wait_for("engine 2 gone", lambda: [e for e in events(run) if e["event"] == "removed" and e["engine"] == 2])
        return real_train(groups)

    async def preempt_when_busy(slot, key):
        auth = {"Authorization": f"Bearer {job.api_key}"}
        async with httpx.AsyncClient(timeout=10) as client:
            deadline = time.monotonic() + WAIT_S
            while True:  # SIGTERM while requests wait in its queue: they cannot be done before it drains
                load = (await client.get(f"{slot.proc.url}/get_load", headers=auth)).json()
                if load["num_waiting_reqs"]:
                    break
                assert time.monotonic() < deadline, f"{slot.name} got no request"
                await asyncio.sleep(0.002)
        preempted[key] = time.time()
        os.kill(slot.proc.process.pid, signal.SIGTERM)

    async def generate(req):
        # step 4: engine 2 preempted (3 -> 1 engines); step 6: the last one, engine 0, which is replaced
        for version, index, key in ((3, 2, "t"), (5, 0, "last")):
            if job.weight_version == version and f"{key}-task" not in preempted:
                preempted[f"{key}-task"] = asyncio.ensure_future(preempt_when_busy(job.fleet.slots[index], key))
        return await real_generate(req)

    job.train, job.client.generate = train, generate
    try:
        asyncio.run(job.run(rl_loop))
        wait_for("engine 0 gone", lambda: [e for e in events(run) if e["event"] == "removed" and e["engine"] == 0])
        check_weights(job, job.fleet.serving())
    finally:
        job.close()

    rows = steps(run)
    trained = [r["group_id"] for step in sorted((run / "rollouts").glob("step-*.jsonl")) for r in read_jsonl(step) if r["index"] == 0]
    check_nothing_lost(trained, rows, batch=4)  # every group trained once, none lost
    assert [r["fleet/engines"] for r in rows] == [1, 3, 2, 1, 1, 1]
    last = rows[-1]
    assert last["fleet/added"] == 3 and last["fleet/removed"] == 3 and last["fleet/restarts"] == 0
    in_flight = int(re.search(r"draining (\d+) in-flight", (run / "engine-2.log").read_text())[1])
    moved = rows[3]["fleet/requests_moved"] - rows[2]["fleet/requests_moved"]
    assert in_flight > 0 and moved >= 1  # what it had at SIGTERM was aborted (drain 0), and moved: its groups regenerated
    assert rows[3]["rollout/groups_regenerated"] >= 1 and rows[5]["rollout/groups_regenerated"] >= 1
    log = events(run)
    joined = [(e["engine"], e["version"]) for e in log if e["event"] == "serving"]
    assert joined == [(1, 1), (2, 1), (3, 5)]  # each added engine served only once it held the run's version, verified
    gone = {e["engine"]: e for e in log if e["event"] == "removed"}
    assert gone[1]["note"] == "removed by noria fleet remove" and gone[2]["note"].startswith("preempted")
    assert gone[0]["note"].startswith("preempted") and [s.index for s in job.fleet.serving()] == [3]  # the last one, replaced
    assert not [e for e in log if e["event"] in ("lost", "restarted")]  # leaving is neither a failure nor a restart
    draining = next(e for e in log if e["event"] == "draining" and e["engine"] == 2)
    print(f"\nshrink by SIGTERM: seen leaving after {draining['seen'] - preempted['t']:.3f} s, out of the router after "
          f"{draining['t'] - preempted['t']:.3f} s, gone after "
          f"{gone[2]['t'] - preempted['t']:.3f} s; {in_flight} requests in flight on it, {moved:g} moved (groups regenerated)")
    assert [e["state"] for e in json.loads((run / "fleet" / "engines.json").read_text())] == ["removed"] * 3 + ["serving"]
    assert not (run / "fleet" / "job.json").exists()


def test_a_request_is_checked_and_a_fleet_without_a_job_is_named(tmp_path):
    """What a request file may hold is data, checked; ``noria fleet`` refuses a folder with no running job."""
    with pytest.raises(NoriaError, match="n must be an integer from 1 to 64"):
        elastic.parse_request('{"action": "add", "n": 1000}', "r")
    with pytest.raises(NoriaError, match="engine must be an engine index"):
        elastic.parse_request('{"action": "remove", "engine": "__import__"}', "r")
    with pytest.raises(NoriaError, match="action must be add or remove"):
        elastic.parse_request('{"action": "exec"}', "r")
    with pytest.raises(NoriaError, match="no engine fleet is running there"):
        elastic.ask(tmp_path, {"action": "add", "n": 1}, timeout_s=1)
    (tmp_path / "fleet").mkdir()
    (tmp_path / "fleet" / "job.json").write_text(json.dumps({"pid": 2**22 + 1}))
    with pytest.raises(NoriaError, match="is gone"):
        elastic.ask(tmp_path, {"action": "add", "n": 1}, timeout_s=1)
