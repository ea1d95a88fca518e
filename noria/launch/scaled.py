"""``ScaledJob``: the local launcher's job with an engine fleet and trainer ranks in their own processes.

``run_rl`` picks it when ``rollout.engines`` > 1, ``rollout.elastic`` or ``train.world_size`` > 1 (and the Ray launcher
builds on it: ``noria.launch.ray.RayJob`` changes only where engines and ranks start). It is
``LocalJob`` (the same ``noria.loop.Job`` calls, scheduler, buffer, run folder and checkpoints)
with two parts swapped:

- engines: ``noria.launch.fleet.EngineFleet`` (``rollout.engines`` ``noria serve`` processes behind
  sglang-router, one per-run API key) and its ``FleetClient`` as the rollout's engine client;
- trainer: ``noria.launch.ranks`` (one ``TrainerRank`` in this process for ``world_size`` 1, else
  ``ProcessRanks``), each rank running ``noria.train.rl_step`` on the same groups; rank 0 pushes the
  weights to every engine of the fleet (``noria.sync``; broadcast in one group, disk as fallback).

When what happens (the safe points, where the trainer's weights are the version the engines serve):

- before each batch is taken: every serving engine must report ``weight_version`` (``check_versions``);
- while ``take_groups`` waits: dead engines are restarted and get the current version pushed to them
  with checksums verified, then rejoin the router; ``noria fleet add|remove`` requests are served and
  an engine that left (preempted) is replaced if it was the last (``between_waits``,
  ``noria.launch.elastic``);
- each ``sync_weights``: dead engines are restarted first, and the push reaches them too; an engine
  that dies during a push is restarted and the push made again, one that leaves during it is left
  out and the push made again (``push_to_fleet``).

Not guaranteed: the PPO critic (``advantage: gae``) with several ranks; colocated placement (the
engines here are always their own processes).
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from noria.config import RunConfig, ensure_valid
from noria.errors import NoriaError
from noria.launch.elastic import FleetControl
from noria.launch.elastic import serve as serve_requests
from noria.launch.fleet import EngineFleet, start_local_engine
from noria.launch.fleet_client import FleetClient
from noria.launch.engine_figures import kv_usage
from noria.launch.job import LocalJob
from noria.launch.ranks import InProcessRanks, ProcessRanks, RankBackend, TrainerRank
from noria.train.offload import check_offload
from noria.types import Group


class ScaledJob(LocalJob):
    """An RL job over an engine fleet and trainer ranks (see the module docstring)."""

    fleet: EngineFleet
    ranks: Any
    grows = True
    """Whether ``noria fleet add`` may start engines here (``noria.launch.elastic``)."""

    @staticmethod
    def check_supported(config: RunConfig) -> None:
        ensure_valid(config)
        if config.train.algorithm != "rl":
            raise NoriaError("run_rl needs train.algorithm: rl")
        check_offload(config)
        if config.train.loss.advantage == "gae" and config.train.world_size > 1:
            raise NoriaError("train.loss.advantage gae (PPO with a critic) runs on one trainer rank; set train.world_size 1")
        if config.rollout.placement != "disaggregated" or config.rollout.engine_url is not None or config.rollout.engine != "noria":
            raise NoriaError("an engine fleet, several trainer ranks or launch: ray need rollout.placement: disaggregated, no "
                             "engine_url and rollout.engine: noria (their engines are `noria serve`)")

    def build_engine(self) -> tuple[Any, Any]:
        """The fleet (its engines and router started) and its client; no one sync target: rank 0 of
        the trainer pushes to every engine (``push``)."""
        r = self.config.rollout
        self.api_key = secrets.token_urlsafe(32)
        self.fleet = EngineFleet(self.engine_starter(), r.engines, self.api_key, r.engine_restarts, r.engine_timeout_s, self.folder,
                                 r.engine_drain_s)  # fmt: skip
        self.fleet.start()
        self.control = FleetControl(self.folder, self.fleet).open()  # noria fleet add|remove
        self.synced_changes = self.fleet.counters.changes
        return FleetClient(self.fleet), None

    def build_trainer(self) -> tuple[Any, Any]:
        """The trainer ranks (set up) behind one backend facade; no critic (refused above with several ranks)."""
        self.ranks = self.start_ranks(self.total_steps * self.config.train.steps_per_rollout)
        return RankBackend(self.ranks), None

    def build_sync(self, target: Any) -> Any:
        """None: the ranks hold the syncs (``push_to_fleet``)."""
        return None

    def engine_starter(self) -> Any:
        """``start(index) -> EngineProc`` of this launcher: a local ``noria serve`` child."""
        return start_local_engine(self.config, self.folder, self.api_key)

    def start_ranks(self, total_steps: int) -> Any:
        """The trainer ranks, set up (model loaded, group joined); rendezvous on 127.0.0.1."""
        from noria.net import free_port

        cfg = self.config
        if cfg.train.world_size == 1:
            ranks: Any = InProcessRanks(TrainerRank(cfg, 0, 1, str(self.folder)))
        else:
            ranks = ProcessRanks(cfg, self.folder)
        ranks.call("setup", "127.0.0.1", free_port(), total_steps)
        return ranks

    # ------------------------------------------------------------------------------ loop calls

    async def take_groups(self) -> list[Group]:
        await self.fleet.check_versions(self.weight_version)  # every engine serves what the run pushed
        return await super().take_groups()

    async def between_waits(self) -> None:
        requests = self.control.take()
        if requests or self.fleet.needs_engine or any(s.state == "lost" for s in self.fleet.slots):
            await asyncio.to_thread(self.change_fleet, requests)
            self.fleet.mark_ready()

    def change_fleet(self, requests: list[dict[str, Any]]) -> None:
        """Restart dead engines and push them the current version, checksums verified; then replace
        the last engine if it left, and serve ``noria fleet`` requests (blocking)."""
        self.push_to_fleet(self.weight_version, only_restarted=True)
        serve_requests(self, requests)

    def train(self, groups: list[Group]) -> dict[str, float]:
        """The RL step on every rank with the same groups; rank 0's metrics (reduced over ranks)."""
        return self.ranks.call("train", groups, self.weight_version)[0]

    async def sync_weights(self, advance: bool = True) -> dict[str, float]:
        metrics = await super().sync_weights(advance)
        self.fleet.mark_ready()
        return metrics

    def push(self, version: int, bucket_bytes: int) -> dict[str, float]:
        """Restart dead engines, then every rank gathers and rank 0 pushes ``version`` to the whole fleet."""
        return self.push_to_fleet(version, only_restarted=False)

    def push_to_fleet(self, version: int, only_restarted: bool) -> dict[str, float]:
        """Restart dead engines, then push ``version`` to every engine (or only to the restarted ones,
        checksums verified) and put them in rotation (blocking). An engine that dies before or during
        the push is found, restarted and pushed to again (each death uses one of its restarts);
        a push that fails with every engine alive raises ``WeightSyncError``."""
        from noria.sync import WeightSyncError

        fleet = self.fleet
        while True:
            fleet.restart_lost()
            if fleet.counters.changes != self.synced_changes:  # the syncs of the old fleet hold a gone engine's group or memory
                self.ranks.call("drop_syncs")
                self.synced_changes = fleet.counters.changes
            new = fleet.unready()  # restarted or added: verified before they serve
            targets = [(s.proc.url, self.api_key) for s in new] if only_restarted else fleet.targets()
            if not targets:
                return {}
            changes = fleet.counters.changes
            metrics, error = self.ranks.call("try_push", targets, version, only_restarted or bool(new))[0]
            if error is None:
                fleet.rejoin(version)
                return metrics
            if not fleet.lost_now() and not fleet.find_draining() and fleet.counters.changes == changes:
                raise WeightSyncError(error)

    def engine_metrics(self) -> dict[str, float]:
        return {**self.fleet.metrics(), **kv_usage(self.fleet.targets())}

    def close(self) -> None:
        try:
            super().close()
        finally:
            if getattr(self, "ranks", None) is not None:
                self.ranks.close()
            if getattr(self, "fleet", None) is not None:
                self.fleet.close()
            if getattr(self, "control", None) is not None:
                self.control.close()

