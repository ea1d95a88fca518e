"""The Ray launcher on a 2-node simulated cluster (``ray.cluster_utils.Cluster``, each node with
its own CPUs): the same results as the local launcher, and an engine actor killed mid-run.

Ray binds some services to the machine's external interface, so these tests run in a network
namespace of their own with only loopback: run plainly, ``test_ray_tests_run_in_their_own_network_namespace``
re-executes this file there (``unshare -n``, root needed, as in CI) and the inner tests (marked
``ray``) run only inside it (``NORIA_NETNS=1``).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from noria.config import load_config
from repo_util import TESTS
from rl_util import check_nothing_lost, fleet_args, run_with_a_kill, steps

INSIDE = os.environ.get("NORIA_NETNS") == "1"
inside_only = pytest.mark.skipif(not INSIDE, reason="runs inside its own network namespace (see the module docstring)")


@pytest.mark.router
@pytest.mark.alone  # Ray's placements and actor starts are timed (ray.ready_timeout_s): beside two other workers one took over 120 s
@pytest.mark.timeout(900)
@pytest.mark.skipif(INSIDE, reason="already inside the namespace")
def test_ray_tests_run_in_their_own_network_namespace():
    pytest.importorskip("ray")
    if os.geteuid() != 0:
        pytest.skip("unshare -n needs root")
    inner = f"ip link set lo up && exec {sys.executable} -m pytest -q -p no:cacheprovider -m ray {Path(__file__).name}"
    # The inner pytest is no worker of this run: it must not wait for this run's room (tests/conftest.py).
    outer = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST") and k != "NORIA_TEST_ROOM"}
    env = {**outer, "NORIA_NETNS": "1", "PYTHONPATH": f"{TESTS}:{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(["unshare", "-n", "sh", "-c", inner], cwd=Path(__file__).parent, env=env, capture_output=True, text=True, timeout=880)
    print(done.stdout[-6000:], done.stderr[-3000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    nodes.add_node(num_cpus=2)
    nodes.wait_for_nodes()
    try:
        yield nodes
    finally:
        import ray

        ray.shutdown()
        nodes.shutdown()


def ray_args(model, address, **extra):
    return fleet_args(model, **{
        "launch": "ray", "ray.address": address, "rollout.engines": 2, "train.backend": "fsdp2", "train.world_size": 2,
        "ray.engine_resources": "{CPU: 1}", "ray.trainer_resources": "{CPU: 1}", "ray.ready_timeout_s": 120, **extra,
    })  # fmt: skip


@pytest.mark.ray
@inside_only
def test_ray_run_on_two_nodes_matches_the_local_launcher(cluster, tiny_model_dir, tmp_path):
    from noria.launch.rl import run_rl
    from noria.launch.ray import RayJob

    local = run_rl(load_config(None, fleet_args(tiny_model_dir)), str(tmp_path / "local"), None, False)
    config = load_config(None, ray_args(tiny_model_dir, cluster.address))
    job = RayJob.build(config, str(tmp_path / "ray"), None, False)
    try:
        import ray

        spread = {ray.util.placement_group_table(job.engine_pool)["bundles_to_node_id"][i] for i in range(2)}
        assert len(spread) == 2  # SPREAD: one engine per node
        from noria.loop import rl_loop

        asyncio.run(job.run(rl_loop))
    finally:
        job.close()
    a, b = steps(local), steps(tmp_path / "ray")
    assert [r["rollout/reward_mean"] for r in a] == [r["rollout/reward_mean"] for r in b]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], abs=1e-5)
    assert b[-1]["rollout/reward_mean"] > b[0]["rollout/reward_mean"]


@pytest.mark.ray
@inside_only
def test_an_engine_actor_killed_mid_run_is_replaced_and_nothing_is_lost(cluster, tiny_model_dir, tmp_path):
    """Asynchronous (staleness 2), where the most can be lost; tests/launch/test_fleet.py kills an engine at
    staleness 0 and 2 under the local launcher, through the same fleet code."""
    import ray

    from noria.launch.ray import RayJob

    extra = {"rollout.max_staleness": 2, "train.loss.off_policy": "tis", "train.max_steps": 4, "train.world_size": 1,
             "train.backend": "single"}  # fmt: skip
    job = RayJob.build(load_config(None, ray_args(tiny_model_dir, cluster.address, **extra)), str(tmp_path / "run"), None, False)
    victim = job.fleet.slots[1].proc
    try:
        trained = run_with_a_kill(job, kill_at=20, kill=lambda: ray.kill(victim.actor))
        rows = steps(tmp_path / "run")
        check_nothing_lost(trained, rows, batch=4)
        assert rows[-1]["fleet/restarts"] == 1 and rows[-1]["fleet/engines"] == 2
        assert job.fleet.slots[1].proc is not victim and job.fleet.slots[1].proc.alive()
        # Every engine, the new actor's included, holds the trainer's weights (checksums).
        job.ranks.call("push", job.fleet.targets(), job.weight_version, True)
    finally:
        job.close()


@pytest.mark.ray
@inside_only
def test_a_job_whose_trainer_pool_cannot_be_placed_gives_back_its_engine_pool(cluster, tiny_model_dir, tmp_path):
    """The engine pool fits, the trainer pool asks for more CPUs than the cluster has: the build stops
    naming that pool, and no placement group is left holding the cluster's CPUs (a pool left behind
    made every later job in the same driver wait for resources that never came)."""
    import ray

    from noria.errors import NoriaError
    from noria.launch.ray import RayJob

    config = load_config(None, ray_args(tiny_model_dir, cluster.address, **{"ray.trainer_resources": "{CPU: 8}", "ray.ready_timeout_s": 5}))
    with pytest.raises(NoriaError, match="the trainer pool .* was not placed within ray.ready_timeout_s=5 s"):
        RayJob.build(config, str(tmp_path / "run"), None, False)
    groups = ray.util.placement_group_table().values()
    assert any(g["name"].startswith("noria-engine-") for g in groups)  # the engine pool was placed first
    assert [g["name"] for g in groups if g["state"] != "REMOVED"] == []
