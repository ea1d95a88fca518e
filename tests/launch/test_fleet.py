"""Scale-out on one machine: an engine fleet behind the real sglang-router, trainer ranks in their
own processes (gloo), weight pushes to N engines checksum-verified, and engines that die mid-run
(CPU, tiny random model, real ``noria serve`` processes on 127.0.0.1; marked ``router``)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch

from engine_server_util import ServeProcess
from noria.config import load_config
from noria.launch.job import LocalJob
from noria.launch.rl import job_class_for, run_rl
from noria.launch.ranks import TrainerRank
from noria.launch.scaled import ScaledJob
from noria.loop import rl_loop
from noria.rollout import EngineFailure
from rl_util import check_nothing_lost, fleet_args, run_with_a_kill, steps

pytestmark = pytest.mark.router
KEY = "fleet-test-key"


def test_two_engines_and_two_ranks_train_as_one_process(tiny_model_dir, tmp_path):
    """Deterministic mode: the same sampled tokens whichever engine serves them (per-sample seeds
    survive the router), so the same rewards, and the same losses from 2 gloo ranks as from one."""
    one = run_rl(load_config(None, fleet_args(tiny_model_dir)), str(tmp_path / "one"), None, False)
    config = load_config(None, fleet_args(tiny_model_dir, **{"rollout.engines": 2, "train.backend": "fsdp2", "train.world_size": 2}))
    assert job_class_for(config) is ScaledJob
    # An engine dies between two steps, just before a push (both ranks are in its gathers): the
    # push finds it dead, restarts it and pushes again; the results do not change.
    job = ScaledJob.build(config, str(tmp_path / "many"), None, False)
    victim, real_push = job.fleet.slots[1].proc, job.push

    def push(version, bucket_bytes):
        if version == 2:
            os.kill(victim.process.pid, signal.SIGKILL)
        return real_push(version, bucket_bytes)

    job.push = push
    ranks = list(job.ranks.processes)
    try:
        asyncio.run(job.run(rl_loop))
    finally:
        job.close()
    # A clean close: every rank passed its last barrier and exited 0 (asked one at a time, rank 0
    # waited in that barrier for rank 1 until its answer timed out, was killed, and rank 1 failed).
    assert [p.exitcode for p in ranks] == [0, 0]
    a, b = steps(one), steps(tmp_path / "many")
    assert b[-1]["fleet/restarts"] == 1 and b[-1]["sync/fallback"] == 0
    assert [r["rollout/reward_mean"] for r in a] == [r["rollout/reward_mean"] for r in b]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], abs=1e-5)
    assert b[-1]["rollout/reward_mean"] > b[0]["rollout/reward_mean"]
    assert all(r["fleet/engines"] == 2 and r["sync/engines"] == 2 and r["rollout/mixed_fleet_frac"] == 0 for r in b)
    for i in (0, 1):  # both engines served requests through the router
        assert "POST /generate" in (tmp_path / "many" / f"engine-{i}.log").read_text() or engine_served(tmp_path / "many", i)


def engine_served(run, index) -> bool:
    """Whether engine ``index`` generated any token (its log may not list requests)."""
    return any(r.get("rollout/tokens", 0) for r in steps(run))


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fleet-logs")
    procs = [ServeProcess(tiny_model_dir, "--api-key", KEY, log_dir=logs) for _ in range(3)]
    try:
        yield [p.wait_ready() for p in procs]
    finally:
        for p in procs:
            p.stop()


def engine_state(proc) -> tuple[int, dict[str, str]]:
    auth = {"Authorization": f"Bearer {KEY}"}
    version = httpx.get(f"{proc.url}/get_weight_version", headers=auth).json()["weight_version"]
    sums = httpx.post(f"{proc.url}/weights_checksum", json={"algo": "sha256"}, headers=auth).json()["checksums"]
    return version, sums


@pytest.mark.parametrize("transport, n", [("broadcast", 2), ("broadcast", 3), ("disk", 3)])
def test_push_reaches_every_engine_and_is_verified_on_each(transport, n, engines, tiny_model_dir, tmp_path):
    config = load_config(None, fleet_args(tiny_model_dir, **{"sync.transport": transport, "sync.bucket_mb": 1}))
    rank = TrainerRank(config, 0, 1, str(tmp_path))
    rank.setup("127.0.0.1", 0, 10)
    try:
        before = [engine_state(e)[1] for e in engines[:n]]
        version = 10 + n + (transport == "disk")
        with torch.no_grad():  # new weights, so that an engine left behind would show
            for p in rank.backend.policy.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(version)))
        metrics = rank.push([(e.url, KEY) for e in engines[:n]], version, verify=True)  # raises on any checksum
        assert metrics["sync/engines"] == n and metrics["sync/verify_seconds"] > 0
        after = [engine_state(e) for e in engines[:n]]
        assert all(v == version for v, _ in after)
        assert all(sums == after[0][1] for _, sums in after)  # every engine holds the same bytes
        assert all(sums != old for (_, sums), old in zip(after, before))
    finally:
        rank.close()


def test_an_engine_serving_another_version_stops_the_run_naming_it(tiny_model_dir, tmp_path):
    config = load_config(None, fleet_args(tiny_model_dir, **{"rollout.engines": 2}))
    job = ScaledJob.build(config, str(tmp_path / "run"), None, False)
    try:
        stray = job.fleet.slots[1].proc.url
        auth = {"Authorization": f"Bearer {job.api_key}"}
        r = httpx.post(f"{stray}/update_weights_from_disk", json={"model_path": str(tiny_model_dir), "weight_version": 5}, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        with pytest.raises(EngineFailure, match=f"engine 1 at {stray} serves weight version 5, but the run pushed 0"):
            asyncio.run(job.run(rl_loop))
    finally:
        job.close()


@pytest.mark.parametrize("staleness", [0, 2])
def test_an_engine_killed_mid_rollout_is_replaced_and_nothing_is_lost(staleness, tiny_model_dir, tmp_path):
    extra = {"rollout.engines": 2, "rollout.max_staleness": staleness, "train.max_steps": 4}
    if staleness:
        extra["train.loss.off_policy"] = "tis"
    job = ScaledJob.build(load_config(None, fleet_args(tiny_model_dir, **extra)), str(tmp_path / "run"), None, False)
    victim = job.fleet.slots[0].proc
    try:
        trained = run_with_a_kill(job, kill_at=20, kill=lambda: os.kill(victim.process.pid, signal.SIGKILL), busy=victim.url)
        rows = steps(tmp_path / "run")
        check_nothing_lost(trained, rows, batch=4)
        assert rows[-1]["fleet/restarts"] == 1 and rows[-1]["fleet/engines"] == 2
        assert sum(r["rollout/groups_regenerated"] for r in rows) >= 1
        replaced = job.fleet.slots[0]
        assert replaced.proc is not victim and replaced.proc.alive() and replaced.restarts == 1
        # The replacement serves the run's current weights, bit for bit (checksums, every engine).
        rank = job.ranks.rank
        sync = rank.sync_for(job.fleet.targets(), verify=True)
        sync.verify_tensors(rank.backend._full_tensors(rank.backend.compute_dtype), job.weight_version)
    finally:
        job.close()


def test_no_engine_left_stops_the_run_naming_the_engine_in_bounded_time(tiny_model_dir, tmp_path):
    config = load_config(None, fleet_args(tiny_model_dir, **{"rollout.engines": 2, "rollout.engine_restarts": 0}))
    job = ScaledJob.build(config, str(tmp_path / "run"), None, False)
    killed = []

    def kill_all():
        for slot in job.fleet.slots:
            os.kill(slot.proc.process.pid, signal.SIGKILL)
        killed.append(time.monotonic())

    try:
        with pytest.raises(EngineFailure, match=r"engine \d at http://127.0.0.1:\d+ died \(process \d+ exited with code -9\) and no engine is left"):
            run_with_a_kill(job, kill_at=3, kill=kill_all)
        assert time.monotonic() - killed[0] < 30
    finally:
        job.close()


def test_a_dead_trainer_rank_stops_the_run_naming_it_and_resume_continues(tiny_model_dir, tmp_path):
    from noria.launch.ranks import TrainerRankFailure

    extra = {"train.backend": "fsdp2", "train.world_size": 2, "train.save_every": 1, "train.max_steps": 3}
    config = load_config(None, fleet_args(tiny_model_dir, **extra))
    job = ScaledJob.build(config, str(tmp_path / "run"), None, False)
    real_train = job.train

    def train(groups):
        if job.step == 2:  # after two committed checkpoints
            os.kill(job.ranks.processes[1].pid, signal.SIGKILL)
        return real_train(groups)

    job.train = train
    try:
        with pytest.raises(TrainerRankFailure, match=r"trainer rank 1 \(pid \d+\) died with exit code -9 during train"):
            asyncio.run(job.run(rl_loop))
    finally:
        job.close()
    assert [r["step"] for r in steps(tmp_path / "run")] == [1, 2]
    run_rl(load_config(None, fleet_args(tiny_model_dir, **extra)), None, str(tmp_path / "run"), False)
    assert [r["step"] for r in steps(tmp_path / "run")] == [1, 2, 3]


def test_one_engine_one_process_stays_the_local_job(tiny_model_dir):
    assert job_class_for(load_config(None, fleet_args(tiny_model_dir))) is LocalJob


def test_engines_on_one_machine_share_its_cores(tiny_model_dir, tmp_path, monkeypatch):
    """N local CPU engines each run on cores / N torch threads (at least 1), set in the engine
    process's environment; one engine runs as this process does."""
    from noria.launch.fleet import shared_machine_threads, start_local_engine

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert shared_machine_threads(load_config(None, fleet_args(tiny_model_dir))) is None
    config = load_config(None, fleet_args(tiny_model_dir, **{"rollout.engines": 2}))
    assert shared_machine_threads(config) == max(1, cores // 2)
    engine = start_local_engine(config, tmp_path, KEY)(0).ready()
    try:
        environ = Path(f"/proc/{engine.process.pid}/environ").read_bytes().split(b"\0")
        assert f"OMP_NUM_THREADS={max(1, cores // 2)}".encode() in environ
    finally:
        engine.stop()


def test_engines_launched_together_load_side_by_side_and_one_that_fails_stops_the_others(tiny_model_dir, tmp_path):
    """A fleet launches its engines, then waits for each (``ready_all``): both processes run before
    the first answers, and when one cannot start (no model in its folder) the failure names it and
    the other engine, already serving, is stopped too: nothing is left running."""
    from noria.engine.child import ready_all
    from noria.launch.fleet import start_local_engine

    config = load_config(None, fleet_args(tiny_model_dir, **{"rollout.engines": 2}))
    start = start_local_engine(config, tmp_path, KEY)
    starts = [start(0), start(1)]
    assert all(s.starting.child.alive() for s in starts)  # both launched before either was waited for
    engines = ready_all(starts)
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        assert len({e.url for e in engines}) == 2
        assert all(httpx.get(f"{e.url}/health", headers=auth).status_code == 200 for e in engines)
    finally:
        for e in engines:
            e.stop()
    (tmp_path / "empty").mkdir()
    config.model.path = str(tmp_path / "empty")
    good, bad = start_local_engine(load_config(None, fleet_args(tiny_model_dir, **{"rollout.engines": 2})), tmp_path, KEY)(0), start(1)
    with pytest.raises(EngineFailure, match="engine server"):
        ready_all([good, bad])
    assert not good.starting.child.alive() and not bad.starting.child.alive()


def test_engines_on_one_machine_share_its_free_memory(tiny_model_dir):
    """N local engines each size their KV cache from kv_memory_fraction / N of free memory (four
    SmolLM2 engines with 30% each were killed for memory on a 24 GB machine); an explicit
    kv_cache_tokens and a lone engine are left as configured."""
    from noria.launch.fleet import shared_machine_config

    def config(engines: int, tokens: int | None):
        c = load_config(None, fleet_args(tiny_model_dir, **{"rollout.engines": engines}))
        c.engine.kv_cache_tokens = tokens  # the tests' configs fix it; a user's default sizes it
        return c

    four = config(4, None)
    assert shared_machine_config(four).engine.kv_memory_fraction == pytest.approx(0.3 / 4)
    assert four.engine.kv_memory_fraction == 0.3  # the run's own config is not changed
    assert shared_machine_config(config(1, None)).engine.kv_memory_fraction == 0.3
    fixed = config(4, 4096)
    assert shared_machine_config(fixed) is fixed
