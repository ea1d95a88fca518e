"""Trainer ranks of an RL job: one ``TrainerRank`` per process, driven in lock step by a rank group.

What this module owns: the trainer side of a job with ``train.world_size`` ranks (FSDP2 over
torch.distributed: gloo on CPU, NCCL on CUDA) and the calls the job makes on them. Every call goes
to every rank with the same arguments, in the same order (FSDP2's collectives need it), and the
job keeps rank 0's answer::

    job --call("train", groups, version)--> rank 0 .. rank W-1: noria.train.rl_step (same groups)
    job --call("push", targets, version)--> every rank gathers the full tensors (collective);
                                           rank 0 sends them to the engines (noria.sync)
    job --call("save" | "load" | "export_hf")--> DCP checkpoint / HF folder (collective)

Rank groups: ``InProcessRanks`` (one rank in the job's process), ``ProcessRanks`` (local
processes, a pipe each; ``noria.launch.scaled``) and the Ray launcher's actors (``noria.launch.ray``).
The rendezvous of a group binds 127.0.0.1 locally, or the node address Ray gives rank 0.

Weight sync from rank 0 (``push``): the transport ``sync.transport`` names; ``auto`` is chosen by
``noria.sync.resolve_transport`` from where the engines are: ipc for engines on rank 0's machine
that memory reaches (a CPU trainer, or the engine on rank 0's own GPU: CUDA IPC), broadcast (one
torch.distributed group from rank 0 to every engine, bucketed) to engines on other GPUs of the
machine, disk (a safetensors folder in the run folder, which must then be on a filesystem every
node shares) when an engine is on another machine. With one rank, an ipc or broadcast push that
fails while every engine is alive falls back to disk for the rest of the run (``sync/fallback``
says so). A push that fails is answered, not raised, through ``try_push`` (the job's call): every
rank has finished its gathers, no rank is failed, and the job looks at its engines (one died:
restart it and push again; none did: stop the run). One ``WeightSync`` is kept per set of engines
(a broadcast group or mapped staging areas live across pushes); when the fleet changes (an engine
restarted) the job drops them all (``drop_syncs``: no mapping of a dead engine's memory is kept).

Failure: a rank that dies (its process exits, its actor is lost) makes the call raise
``TrainerRankFailure`` naming the rank and how it ended; the job stops (the other ranks may be
stuck in a collective: the group is torn down) and ``--resume`` continues from the last committed
checkpoint. Not guaranteed: the PPO critic (``advantage: gae``) runs with one rank only.
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path
from typing import Any

from noria.config import RunConfig
from noria.errors import NoriaError


class TrainerRankFailure(NoriaError):
    """A trainer rank died or failed; the message names the rank."""


class TrainerRank:
    """One rank: the backend on this process's device, the RL step, and (rank 0) the weight sync."""

    def __init__(self, config: RunConfig, rank: int, world: int, folder: str, device: str | None = None) -> None:
        self.config, self.rank, self.world, self.folder = config, rank, world, Path(folder)
        self.device = device or config.train.device
        self.backend: Any = None
        self.syncs: dict[tuple, Any] = {}
        self.fallback = False
        self.pixels: Any = None

    def setup(self, master_addr: str, master_port: int, total_steps: int) -> str:
        """Join the group (W > 1), load the model, build the optimizer; returns this rank's node address."""
        import dataclasses

        from noria.launch.parts import backend_options
        from noria.models.catalog import model_path
        from noria.net import node_address
        from noria.train import build_backend

        cfg = self.config
        if self.world > 1:
            local = str(_cuda_index(self.device)) if self.device.startswith("cuda") else os.environ.get("LOCAL_RANK", "0")
            os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                              WORLD_SIZE=str(self.world), LOCAL_RANK=local)  # fmt: skip
            from noria.train.fsdp import init_distributed

            init_distributed(self.device)
        train = dataclasses.replace(cfg.train, device=self.device)
        self.backend = build_backend(train, model_impl=cfg.model.impl, seed=cfg.seed, **backend_options(cfg))
        self.backend.init(model_path(cfg.model.path), total_steps=total_steps)
        return node_address()

    def train(self, groups: list, weight_version: int) -> dict[str, float]:
        from noria.train.rl_step import rl_step

        cfg = self.config
        if self.pixels is None:  # a vision-language model's images, read from the run folder by a rank in its own process
            from noria.models.catalog import model_path
            from noria.run_folder import IMAGES
            from noria.train.images import SamplePixels

            self.pixels = SamplePixels(model_path(cfg.model.path), self.folder / IMAGES)
        return rl_step(self.backend, groups, cfg.train, weight_version, None, cfg.rollout.routing_replay, pixels=self.pixels)

    def push(self, targets: list[tuple[str, str | None]], version: int, verify: bool = False) -> dict[str, float]:
        """Every rank gathers the full tensors; rank 0 sends them to ``targets`` ((url, api key) each).
        Raises ``WeightSyncError``; every rank has finished its gathers by then (they are collective)."""
        from noria.sync import WeightSyncError
        from noria.train.rl_step import on_device

        bucket = self.config.sync.bucket_mb << 20
        with on_device(self.backend.device):
            if self.rank != 0:
                for _ in self.backend.state_dict_for_sync(bucket):  # the gathers are collective
                    pass
                return {}
            sync = buckets = None
            try:
                sync = self.sync_for(targets, verify)
                buckets = self.backend.state_dict_for_sync(bucket, cast=not sync.casts_on_write)
                metrics = sync.push(buckets, version)
            except WeightSyncError:
                for _ in buckets if buckets is not None else self.backend.state_dict_for_sync(bucket):
                    pass  # the other ranks run every gather: run them too
                if sync is None or sync.transport == "disk" or self.config.sync.transport != "auto" or self.world > 1:
                    raise  # (W > 1: the others have finished their gathers, a second push would hang them)
                if not all(_answers(engine) for engine in sync.targets):
                    raise  # an engine died: the job restarts it, the transport is not to blame
                self.fallback = True
                self.drop_syncs()
                metrics = self.sync_for(targets, verify).push(self.backend.state_dict_for_sync(bucket), version)
        metrics["sync/fallback"] = float(self.fallback)
        metrics["sync/engines"] = float(len(targets))
        return metrics

    def try_push(self, targets: list[tuple[str, str | None]], version: int, verify: bool = False) -> tuple[dict[str, float], str | None]:
        """:meth:`push`, with a failed push answered as ``({}, message)`` instead of raised: the rank
        lives on (its process or actor is not failed), and the job, which knows the fleet, decides
        whether an engine died (restart it, push again) or the push failed (stop the run)."""
        from noria.sync import WeightSyncError

        try:
            return self.push(targets, version, verify), None
        except WeightSyncError as e:
            return {}, str(e)

    def sync_for(self, targets: list[tuple[str, str | None]], verify: bool) -> Any:
        """The ``WeightSync`` to exactly these engines (kept: its broadcast group lives across pushes)."""
        import dataclasses

        from noria.models.catalog import model_path
        from noria.sync import HttpEngine, build_sync

        key = (tuple(targets), verify)
        if key not in self.syncs:
            cfg = self.config.sync
            if cfg.transport == "auto" and self.fallback:
                cfg = dataclasses.replace(cfg, transport="disk")
            cfg = dataclasses.replace(cfg, verify=cfg.verify or verify)
            if cfg.broadcast_backend == "auto" and self.device.startswith("cuda"):
                cfg = dataclasses.replace(cfg, broadcast_backend="gloo")  # engines may share the trainer's GPU
            engines = [HttpEngine(url, api_key=k) for url, k in targets]
            self.syncs[key] = build_sync(cfg, engines, run_dir=self.folder, source=model_path(self.config.model.path), device=self.device)
        return self.syncs[key]

    def drop_syncs(self) -> None:
        for sync in self.syncs.values():
            try:
                sync.close()
            except Exception:  # noqa: BLE001 -- best effort: an engine of it may be gone
                pass
        self.syncs.clear()

    def save(self, folder: str, extra: dict[str, Any]) -> str:
        return str(self.backend.save(folder, extra=extra))

    def load(self, folder: str) -> dict[str, Any]:
        return self.backend.load(folder)

    def export_hf(self, folder: str) -> str:
        return str(self.backend.export_hf(folder))

    def optimizer_steps(self) -> int:
        return int(self.backend.optimizer_steps)

    def close(self) -> None:
        self.drop_syncs()
        from noria.train.fsdp import shutdown_distributed

        shutdown_distributed()


def _answers(engine: Any) -> bool:
    """Whether a sync target (``noria.sync.HttpEngine``) still answers: it reports its weight version."""
    from noria.sync import WeightSyncError

    try:
        engine.version()
        return True
    except WeightSyncError:
        return False


class RankBackend:
    """The job's view of its ranks where it needs a backend (``save``, ``load``, ``export_hf``):
    every call goes to every rank, rank 0's answer comes back."""

    def __init__(self, ranks: Any) -> None:
        self.ranks = ranks

    def save(self, folder: Path, extra: dict[str, Any]) -> Path:
        return Path(self.ranks.call("save", str(folder), extra)[0])

    def load(self, folder: Path) -> dict[str, Any]:
        return self.ranks.call("load", str(folder))[0]

    def export_hf(self, folder: Path) -> Path:
        return Path(self.ranks.call("export_hf", str(folder))[0])

    @property
    def optimizer_steps(self) -> int:
        return self.ranks.call("optimizer_steps")[0]


class InProcessRanks:
    """One rank in the job's own process (``train.world_size`` 1)."""

    def __init__(self, rank: TrainerRank) -> None:
        self.rank = rank

    def call(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.rank, method)(*args)]

    def close(self) -> None:
        self.rank.close()


def _cuda_index(device: str) -> int:
    """``cuda`` -> 0, ``cuda:K`` -> K."""
    return int(device.partition(":")[2] or 0)


def local_rank_device(device: str, rank: int, world: int) -> str:
    """The device of local trainer rank ``rank`` of ``world`` (processes spawned on this machine by
    ``train.world_size``): ``train.device`` ``cuda`` or ``cuda:K`` puts rank r on cuda:K+r, one GPU
    each (NCCL refuses two ranks on one device); a CPU device is every rank's. Raises NoriaError,
    naming the keys, where this machine has too few GPUs."""
    if not device.startswith("cuda"):
        return device
    index = _cuda_index(device) + rank
    import torch

    if index >= torch.cuda.device_count():
        raise NoriaError(
            f"train.world_size={world} with train.device={device!r} puts trainer rank {rank} on cuda:{index}, "
            f"but this machine has {torch.cuda.device_count()} CUDA GPU(s): ranks take one GPU each, from "
            f"cuda:{_cuda_index(device)} on (lower train.world_size, or use launch: ray for GPUs on several machines)"
        )
    return f"cuda:{index}"


def rank_main(rank: int, connection: Any, config: RunConfig, world: int, folder: str) -> None:
    """A local rank process (run by ``rank_process``): run each ``(method, args)`` from the pipe,
    answer ``(ok, result)``, until ``close`` or the job is gone."""
    from noria.process.env import multicast_off
    from noria.train.fsdp import shutdown_distributed

    multicast_off()
    trainer = TrainerRank(config, rank, world, folder, local_rank_device(config.train.device, rank, world))
    while True:
        try:
            method, args = connection.recv()
        except EOFError:  # the job is gone: the other ranks may be too, so no barrier
            shutdown_distributed(clean=False)
            return
        try:
            connection.send((True, getattr(trainer, method)(*args)))
        except BaseException as e:  # noqa: BLE001 -- sent to the job, which raises it naming the rank
            connection.send((False, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))
        if method == "close":
            return


class ProcessRanks:
    """``train.world_size`` local rank processes (spawned), each driven through a pipe."""

    def __init__(self, config: RunConfig, folder: Path, poll_s: float = 0.5) -> None:
        from noria.process import spawn_context, start_process
        from noria.train.fsdp import rank_process

        self.poll_s = poll_s
        self.pipes, self.processes = [], []
        world = config.train.world_size
        for rank in range(world):  # refused here, before any rank starts, where the GPUs are too few
            local_rank_device(config.train.device, rank, world)
        for rank in range(world):
            ours, theirs = spawn_context().Pipe()
            process = start_process(rank_process, (rank, rank_main, theirs, config, world, str(folder)), name=f"noria-rank-{rank}")
            theirs.close()
            self.pipes.append(ours)
            self.processes.append(process)

    def call(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every rank; raises ``TrainerRankFailure`` naming the first rank that
        died or failed (the others are stopped: they may wait in a collective forever)."""
        for pipe in self.pipes:
            pipe.send((method, args))
        return [self._answer(rank, method) for rank in range(len(self.pipes))]

    def _answer(self, rank: int, method: str) -> Any:
        pipe, process = self.pipes[rank], self.processes[rank]
        while not pipe.poll(self.poll_s):
            self.fail_if_dead(method)
        try:
            ok, result = pipe.recv()
        except EOFError:
            process.join(5)
            self.fail_if_dead(method)
            self.fail(f"trainer rank {rank} (pid {process.pid}) closed its pipe during {method}")
        if not ok:  # a collective broken by a rank that died fails the others too: name the dead one
            time.sleep(self.poll_s)
            self.fail_if_dead(method, f"; rank {rank} then failed: {result.splitlines()[0]}")
            self.fail(f"trainer rank {rank} failed in {method}: {result}")
        return result

    def fail_if_dead(self, method: str, more: str = "") -> None:
        for rank, process in enumerate(self.processes):
            if process.exitcode is not None:
                self.fail(f"trainer rank {rank} (pid {process.pid}) died with exit code {process.exitcode} during {method}{more}")

    def fail(self, message: str) -> None:
        self.close(graceful=False)
        raise TrainerRankFailure(message)

    def close(self, graceful: bool = True) -> None:
        """Stop every rank: gracefully, ``close`` goes to all of them before any answer is awaited
        (each rank's close ends in a barrier with the others: asked one at a time, the first would
        wait there for a rank not yet asked, until the answer's timeout)."""
        asked = []
        for pipe, process in zip(self.pipes, self.processes):
            if graceful and process.exitcode is None:
                try:
                    pipe.send(("close", ()))
                    asked.append(pipe)
                except OSError:
                    pass
        for pipe in asked:
            try:
                pipe.poll(30) and pipe.recv()
            except (OSError, EOFError):
                pass
        for process in self.processes:
            process.join(5 if graceful else 0)
            if process.exitcode is None:
                process.kill()
                process.join()
        self.pipes, self.processes = [], []
