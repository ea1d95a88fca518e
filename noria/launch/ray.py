"""The Ray launcher (``launch: ray``): engines and trainer ranks as Ray actors in placement groups;
this process (the driver) runs the same loop, scheduler, buffer, run folder and checkpoints.

``RayJob`` is ``noria.launch.scaled.ScaledJob`` with two things changed, where the parts start::

    driver (this process): rl_loop, RolloutScheduler, buffer, FleetClient, sglang-router, run folder
    engine pool  (placement group, ray.engine_strategy, one bundle of ray.engine_resources per engine):
        EngineActor i -> a `noria serve` child on the actor's node (bound to that node's address,
                         on the GPU Ray assigned the actor, if any); dies with the actor
    trainer pool (placement group, ray.trainer_strategy, one bundle of ray.trainer_resources per rank):
        TrainerRankActor r -> noria.launch.ranks.TrainerRank (FSDP2 rank r; rendezvous at rank 0's node)

What blocks on what: the placement groups must be placed (``ray.ready_timeout_s``) before any actor
starts; the engines start side by side, then the ranks together (they rendezvous). Each call on the ranks
waits for every rank (``RayRanks.call``).

Ray itself: ``ray.address`` null starts a private instance in this process on 127.0.0.1 (stopped
at the end of the run); an address joins that cluster (a ``ray.cluster_utils.Cluster`` in tests, a
real cluster's head otherwise). Ray binds some of its own services to the machine's external
interface whatever it is told, so the tests run it in a network namespace with only loopback.

Faults: an engine actor that dies is found by the fleet (``alive`` asks the actor; a lost actor is
dead) and replaced by a new actor in the same bundle (``noria.launch.fleet``); a trainer-rank actor
that dies makes the call raise ``TrainerRankFailure`` naming the rank.

Not guaranteed (not run here): GPUs (the code gives each actor the GPU Ray assigns it, but this
launcher ran on CPU only), nodes on separate machines (engines bind the node address Ray reports;
the weight push then goes over disk, which needs a filesystem every node shares, see
``noria.launch.ranks``), colocated pools (engines and ranks sharing bundles).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from noria.config import RunConfig
from noria.errors import NoriaError
from noria.launch.ranks import TrainerRank, TrainerRankFailure
from noria.launch.scaled import ScaledJob


def ray_module() -> Any:
    try:
        import ray
    except ImportError as e:
        raise NoriaError('launch: ray needs Ray: pip install -e ".[ray]" (ray[default]==2.60.*)') from e
    return ray


def start_ray(address: str | None) -> bool:
    """Connect to ``address`` or start a private instance on 127.0.0.1; True when this call started it."""
    ray = ray_module()
    if ray.is_initialized():
        return False
    if address is None:
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)
    return True


class EngineActorImpl:
    """One engine of the pool: a ``noria serve`` child of this actor, on this actor's node."""

    def __init__(self, config: RunConfig, folder: str, api_key: str, index: int) -> None:
        self.config, self.folder, self.api_key, self.index = config, Path(folder), api_key, index
        self.process: Any = None

    def start(self) -> str:
        import os

        import ray

        from noria.engine.child import start_engine_server
        from noria.models.catalog import model_path

        host = ray.util.get_node_ip_address()
        device = self.config.rollout.engine_device or self.config.model.device
        if ray.get_gpu_ids():  # Ray set CUDA_VISIBLE_DEVICES to this actor's GPU
            device = "cuda:0"
        os.environ["NORIA_NODE_ADDRESS"] = host
        self.process, url, _ = start_engine_server(
            model_path(self.config.model.path), self.config, self.folder, device=device,
            log_name=f"engine-{self.index}.log", api_key=self.api_key, host=host, drain_timeout_s=self.config.rollout.engine_drain_s,
        )  # fmt: skip
        return url

    def exit_code(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(timeout_s=10.0)


class RayEngineProc:
    """The fleet's handle on an engine actor (``noria.launch.fleet.EngineProc``)."""

    def __init__(self, actor: Any, url: str) -> None:
        self.actor, self.url = actor, url
        self.note = ""

    def alive(self) -> bool:
        ray = ray_module()
        try:
            code = ray.get(self.actor.exit_code.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            self.note = f"Ray actor lost ({type(e).__name__})"
            return False
        if code is not None:
            self.note = f"its process exited with code {code}"
        return code is None

    def exit_note(self) -> str:
        return self.note or "not answering"

    def stop(self) -> None:
        ray = ray_module()
        try:
            ray.get(self.actor.stop.remote(), timeout=30)
        except Exception:  # noqa: BLE001 -- a dead actor has nothing left to stop
            pass
        ray.kill(self.actor)


class RayStart:
    """An engine actor asked to start its engine, not yet answered (``EngineFleet``'s start protocol):
    the actors of a pool start side by side."""

    def __init__(self, actor: Any, started: Any, timeout_s: float) -> None:
        self.actor, self.started, self.timeout_s = actor, started, timeout_s

    def ready(self) -> RayEngineProc:
        return RayEngineProc(self.actor, ray_module().get(self.started, timeout=self.timeout_s))

    def stop(self) -> None:
        RayEngineProc(self.actor, "").stop()


class RayRanks:
    """Trainer ranks as Ray actors; ``call`` runs a method on all of them and waits for all."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors

    def call(self, method: str, *args: Any) -> list[Any]:
        ray = ray_module()
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            rank = refs.index(done[0])
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as e:
                self.close(graceful=False)
                raise TrainerRankFailure(f"trainer rank {rank} (Ray actor) died during {method}: {e}") from e
            except ray.exceptions.RayTaskError as e:
                self.close(graceful=False)
                raise TrainerRankFailure(f"trainer rank {rank} failed in {method}: {e.cause!r}") from e
        return ray.get(refs)

    def close(self, graceful: bool = True) -> None:
        ray = ray_module()
        if graceful and self.actors:
            try:
                ray.get([a.close.remote() for a in self.actors], timeout=60)
            except Exception:  # noqa: BLE001 -- a rank already gone
                pass
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


class RayJob(ScaledJob):
    """``ScaledJob`` whose engines and trainer ranks are Ray actors (see the module docstring)."""

    grows = False  # the engine pool is a placement group of rollout.engines bundles: noria fleet add is refused

    @staticmethod
    def check_supported(config: RunConfig) -> None:
        ScaledJob.check_supported(config)
        ray_module()

    def start_parts(self, resume: bool) -> None:
        cfg = self.config
        self.started_ray = start_ray(cfg.ray.address)
        self.engine_pool = self.placement_group(cfg.ray.engine_resources, cfg.rollout.engines, cfg.ray.engine_strategy, "engine")
        self.trainer_pool = self.placement_group(cfg.ray.trainer_resources, cfg.train.world_size, cfg.ray.trainer_strategy, "trainer")
        super().start_parts(resume)

    def placement_group(self, resources: dict[str, float], n: int, strategy: str, what: str) -> Any:
        from ray.util.placement_group import placement_group

        group = placement_group([dict(resources) for _ in range(n)], strategy=strategy, name=f"noria-{what}-{self.folder.name}")
        ray = ray_module()
        try:
            ray.get(group.ready(), timeout=self.config.ray.ready_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(group)  # left pending, it would take the resources whenever they free up
            raise NoriaError(
                f"the {what} pool ({n} x {resources}, {strategy}) was not placed within ray.ready_timeout_s="
                f"{self.config.ray.ready_timeout_s:g} s: the cluster lacks those resources ({ray.available_resources()})"
            ) from e
        return group

    def actor_options(self, group: Any, index: int, resources: dict[str, float]) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
        return {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index),
            "num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0), "resources": custom or None,
            "max_restarts": 0,  # a lost actor is replaced by the launcher (fleet) or stops the run (ranks)
        }  # fmt: skip

    def engine_starter(self) -> Any:
        ray = ray_module()
        actor_class = ray.remote(EngineActorImpl)
        cfg = self.config

        def start(index: int) -> RayStart:
            options = self.actor_options(self.engine_pool, index, cfg.ray.engine_resources)
            actor = actor_class.options(**options).remote(cfg, str(self.folder), self.api_key, index)
            return RayStart(actor, actor.start.remote(), cfg.ray.ready_timeout_s)

        return start

    def start_ranks(self, total_steps: int) -> RayRanks:
        ray = ray_module()
        cfg = self.config
        actor_class = ray.remote(TrainerRankActorImpl)
        world = cfg.train.world_size
        actors = [
            actor_class.options(**self.actor_options(self.trainer_pool, r, cfg.ray.trainer_resources)).remote(cfg, r, world, str(self.folder))
            for r in range(world)
        ]  # fmt: skip
        ranks = RayRanks(actors)
        address, port = ray.get(actors[0].rendezvous.remote(), timeout=cfg.ray.ready_timeout_s)
        ranks.call("setup", address, port, total_steps)
        return ranks

    def close(self) -> None:
        try:
            super().close()
        finally:
            ray = ray_module()
            from ray.util.placement_group import remove_placement_group

            for name in ("engine_pool", "trainer_pool"):
                if getattr(self, name, None) is not None:
                    remove_placement_group(getattr(self, name))
            if getattr(self, "started_ray", False):
                ray.shutdown()


class TrainerRankActorImpl(TrainerRank):
    """A trainer rank inside a Ray actor: its device is the GPU Ray assigned it (else the config's)."""

    def __init__(self, config: RunConfig, rank: int, world: int, folder: str) -> None:
        import os

        import ray

        from noria.process.env import multicast_off

        multicast_off()
        os.environ["NORIA_NODE_ADDRESS"] = ray.util.get_node_ip_address()
        device = "cuda:0" if ray.get_gpu_ids() else config.train.device
        super().__init__(config, rank, world, folder, device=device)

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: the address and a free port of its node, where the group meets."""
        from noria.net import free_port, node_address

        return node_address(), free_port(node_address())

