"""The engine fleet: ``rollout.engines`` ``noria serve`` engines behind the real sglang-router, and
the client rollout uses to reach them (``FleetClient``, an ``EngineClient``).

What this module owns: starting the engines (through a ``start`` function the launcher gives: a
local child process, ``start_local_engine``, or a Ray actor, ``noria.launch.ray``), the router in
front of them, each engine's state, and what happens when one dies::

    rollout --generate--> FleetClient --(N > 1) sglang-router, manual policy, min_load--> engine i
                                      --(N = 1) the engine itself
    job --pause/resume, versions--> every serving engine (fan-out)
    job --push (noria.launch.ranks)--> every engine of ``targets()``

Routing (N > 1): one sglang-router (``noria.router.sglang_router``) with the manual policy and the
min_load assignment: a request without a routing key (single-turn work) goes to the least-loaded
engine; a request of a session carries its key and sticks to one engine. The router holds the run's
API key (in its environment) and talks to the engines with it.

Engine states: ``serving`` (in rotation), ``lost`` (found dead: out of the router), ``restarted`` (a
new process or actor, not yet holding the run's weights: out of rotation until the job pushes the
current version to it and calls ``rejoin``), ``retired`` (dead with no restarts left).

Death: a request that fails makes the client look at every engine (process or actor alive?); the
dead ones are marked lost and the request raises ``EngineLost`` (the scheduler regenerates the
group once ``ready`` returns). A dead engine with restarts left (``rollout.engine_restarts``) is
started again by the job at its next safe point (``restart_lost``, between rollout waits or before
a push, when the trainer's weights are the version the engines must serve), re-synced with the
checksums verified, and put back in rotation. With no engine serving and none to restart, the
failure is an ``EngineFailure`` naming the engine and how it ended, raised at once.

Versions: ``check_versions(v)`` asks every serving engine which weight version it serves; one that
serves another version than the run pushed stops the run, naming it. ``rollout/mixed_fleet_frac``
counts requests made while the live engines were known to hold different versions.

The router's own retries and circuit breaker are off: a failed request comes back here, where the
engine's death is found and its group regenerated (a retry inside the router would hide which
engine died, and its backoff would stall the rollout).

Not guaranteed: a session (agent) whose engine dies mid-conversation fails that sample (the session
server answers the agent an error) rather than regenerating its group.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from noria.process import Child
from noria.rollout import EngineFailure, HttpEngineClient
from noria.rollout.scheduler import EngineLost


class EngineProc(Protocol):
    """One running engine, however it was started."""

    url: str

    def alive(self) -> bool: ...

    def exit_note(self) -> str:
        """How it ended (``exit code -9``, ``actor died``), for errors."""
        ...

    def stop(self) -> None: ...


@dataclass
class Slot:
    """Engine ``index`` of the fleet: its current process or actor and its state."""

    index: int
    proc: Any
    client: HttpEngineClient
    state: str = "serving"
    restarts: int = 0
    version: int = 0
    lost_note: str = ""
    losses: int = 0

    @property
    def name(self) -> str:
        return f"engine {self.index} at {self.proc.url}"


@dataclass
class FleetCounters:
    requests: int = 0
    mixed: int = 0
    restarts: int = 0
    losses: int = 0
    """Engines found dead so far: a request that fails after this grew while it ran failed on one."""


class EngineFleet:
    """``n`` engines started by ``start(index) -> EngineProc``, a router for n > 1."""

    def __init__(self, start: Callable[[int], Any], n: int, api_key: str, restarts: int, timeout_s: float, folder: Path) -> None:
        self.start_engine, self.n, self.api_key = start, n, api_key
        self.max_restarts, self.timeout_s, self.folder = restarts, timeout_s, folder
        self.slots: list[Slot] = []
        self.router: Any = None
        self.counters = FleetCounters()
        self.spawner = ThreadPoolExecutor(1, thread_name_prefix="noria-fleet-spawn")
        """Restarts start engines from this one thread, which lives as long as the fleet: a child dies with
        the thread that started it (``noria.process.lifecycle``), and the job's worker threads come and go."""
        self.dead_urls: set[str] = set()
        """URLs of engines found dead (a request the router sent there before it dropped them fails naming one)."""
        self._ready: asyncio.Event | None = None
        self._marking = threading.Lock()

    def start(self) -> EngineFleet:
        """Start every engine, then the router in front of them. One after the other, from this
        thread: a child dies with the thread that started it (``noria.process.lifecycle``), so none
        is started from a short-lived pool thread."""
        procs = [self.start_engine(i) for i in range(self.n)]
        self.slots = [Slot(i, p, self.client_for(p)) for i, p in enumerate(procs)]
        if self.n > 1:
            from noria.router.sglang_router import SglangRouter

            self.router = SglangRouter(
                [p.url for p in procs], api_key=self.api_key, log_path=self.folder / "router.log",
                extra_args=["--disable-retries", "--disable-circuit-breaker"],  # a failure is this client's to handle
            ).start()  # fmt: skip
        return self

    def client_for(self, proc: Any) -> HttpEngineClient:
        return HttpEngineClient(proc.url, api_key=self.api_key, timeout_s=self.timeout_s, process=getattr(proc, "process", None))

    # ---------------------------------------------------------------------------- state

    def serving(self) -> list[Slot]:
        return [s for s in self.slots if s.state == "serving"]

    def targets(self) -> list[tuple[str, str]]:
        """(url, key) of every engine a push must reach: serving and restarted ones."""
        return [(s.proc.url, self.api_key) for s in self.slots if s.state in ("serving", "restarted")]

    @property
    def mixed(self) -> bool:
        return len({s.version for s in self.serving()}) > 1

    def ready_event(self) -> asyncio.Event:
        if self._ready is None:
            self._ready = asyncio.Event()
            self._ready.set()
        return self._ready

    async def wait_ready(self) -> None:
        await self.ready_event().wait()

    async def find_lost(self, grace_s: float = 2.0) -> list[Slot]:
        """:meth:`lost_now` from the event loop (on a worker thread: it may wait for the router)."""
        return await asyncio.to_thread(self.lost_now, grace_s)

    def lost_now(self, grace_s: float = 2.0) -> list[Slot]:
        """Mark engines that died (serving ones, and restarted ones not yet in rotation) as lost and
        take them out of the router; a dying process gets ``grace_s`` to show it is gone. Raises
        ``EngineFailure`` when none serves and none can restart (blocking; any thread)."""
        deadline = time.monotonic() + grace_s
        while True:
            lost = [s for s in self.slots if s.state in ("serving", "restarted") and not s.proc.alive()]
            if lost or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        with self._marking:  # several failed requests look at once: each death is counted once
            lost = [s for s in lost if s.state in ("serving", "restarted")]
            in_router = [s for s in lost if s.state == "serving"]
            for slot in lost:
                slot.state, slot.lost_note = "lost", slot.proc.exit_note()
                slot.losses += 1
                self.counters.losses += 1
                self.dead_urls.add(slot.proc.url)
        if self.router is not None:
            for slot in in_router:
                self.router.remove_worker(slot.proc.url)
        if not self.serving():
            self.ready_event().clear()
            self.check_left()
        return lost

    def check_left(self) -> None:
        """``EngineFailure`` naming a dead engine when no engine serves and none may restart."""
        if self.serving() or any(s.state == "restarted" for s in self.slots):
            return
        restartable = [s for s in self.slots if s.state == "lost" and s.restarts < self.max_restarts]
        if not restartable:
            dead = next(s for s in self.slots if s.state in ("lost", "retired"))
            raise EngineFailure(
                f"{dead.name} died ({dead.lost_note}) and no engine is left: {dead.restarts} restarts of "
                f"rollout.engine_restarts={self.max_restarts} used; the run stops"
            )

    def restart_lost(self) -> list[Slot]:
        """Start a new engine for every lost one with restarts left (blocking; no weights pushed yet)."""
        started = []
        for slot in [s for s in self.slots if s.state == "lost"]:
            if slot.restarts >= self.max_restarts:
                slot.state = "retired"
                continue
            slot.proc.stop()
            slot.proc = self.spawner.submit(self.start_engine, slot.index).result()
            slot.client = self.client_for(slot.proc)
            slot.restarts += 1
            slot.state = "restarted"
            self.counters.restarts += 1
            started.append(slot)
        self.check_left()
        return started

    def rejoin(self, version: int) -> None:
        """After a push of ``version``: restarted engines go (back) into rotation; every engine
        pushed to now serves ``version`` (blocking: the router registers the engines)."""
        for slot in self.slots:
            if slot.state == "restarted" and self.router is not None:
                self.router.add_worker(slot.proc.url)
            if slot.state in ("serving", "restarted"):
                slot.state, slot.version = "serving", version

    def mark_ready(self) -> None:
        if self.serving():
            self.ready_event().set()

    async def check_versions(self, expected: int) -> None:
        """Every serving engine must serve ``expected``; ``EngineFailure`` naming the first that does not."""

        async def one(slot: Slot) -> None:
            try:
                slot.version = await slot.client.weight_version()
            except EngineFailure:
                if slot.proc.alive():
                    raise
                return  # dead: found by find_lost below
            if slot.version != expected:
                raise EngineFailure(
                    f"{slot.name} serves weight version {slot.version}, but the run pushed {expected}: "
                    "it took weights from elsewhere or missed a push; stopping rather than train on them"
                )

        await asyncio.gather(*(one(s) for s in self.serving()))
        await self.find_lost(grace_s=0.0)

    def metrics(self) -> dict[str, float]:
        c = self.counters
        out = {
            "rollout/mixed_fleet_frac": c.mixed / c.requests if c.requests else 0.0,
            "fleet/engines": float(len(self.serving())),
            "fleet/restarts": float(c.restarts),
        }
        c.requests = c.mixed = 0
        return out

    def close(self) -> None:
        if self.router is not None:
            self.router.stop()
        for slot in self.slots:
            slot.proc.stop()
        self.spawner.shutdown(wait=False)


class FleetClient:
    """The ``EngineClient`` rollout uses over a fleet: generation through the router (or the one
    engine), control calls fanned out to every serving engine."""

    def __init__(self, fleet: EngineFleet) -> None:
        self.fleet = fleet
        self.name = "engine fleet"
        self.router_client = None
        if fleet.router is not None:
            self.router_client = HttpEngineClient(fleet.router.url, api_key=fleet.api_key, timeout_s=fleet.timeout_s)

    async def generate(self, req: Any) -> Any:
        fleet = self.fleet
        await fleet.wait_ready()
        serving = fleet.serving()
        client = self.router_client if self.router_client is not None else serving[0].client
        mixed, losses = fleet.mixed, fleet.counters.losses
        try:
            out = await client.generate(req)
        except EngineFailure as e:
            await fleet.find_lost()
            dead = [url for url in fleet.dead_urls if url in str(e)]  # the router names the worker it could not reach
            lost = [s for s in fleet.slots if s.losses > 0] if fleet.counters.losses > losses or dead else []
            if not lost:  # no engine died while it ran: a failure of its own, which stops the run
                raise
            names = ", ".join(f"{s.name} ({s.lost_note})" for s in lost)
            raise EngineLost(f"{names} died under a request; its group is regenerated", fleet.wait_ready) from e
        fleet.counters.requests += 1
        fleet.counters.mixed += int(mixed or fleet.mixed)
        return out

    async def fan_out(self, call: Callable[[HttpEngineClient], Any]) -> None:
        """``call`` on every serving engine; a failure of an engine found dead is left to find_lost."""
        slots = self.fleet.serving()
        results = await asyncio.gather(*(call(s.client) for s in slots), return_exceptions=True)
        for slot, result in zip(slots, results):
            if isinstance(result, BaseException) and await asyncio.to_thread(slot.proc.alive):
                raise result
        await self.fleet.find_lost(grace_s=0.0)

    async def pause(self, mode: str = "retract") -> None:
        await self.fan_out(lambda c: c.pause(mode))

    async def resume(self) -> None:
        await self.fan_out(lambda c: c.resume())

    async def release_memory(self) -> None:
        await self.fan_out(lambda c: c.release_memory())

    async def resume_memory(self) -> None:
        await self.fan_out(lambda c: c.resume_memory())

    async def weight_version(self) -> int:
        return min(await asyncio.gather(*(s.client.weight_version() for s in self.fleet.serving())))

    async def aclose(self) -> None:
        for slot in self.fleet.slots:
            await slot.client.aclose()
        if self.router_client is not None:
            await self.router_client.aclose()


class LocalEngineProc:
    """A ``noria serve`` child process of this job (``noria.engine.child.start_engine_server``)."""

    def __init__(self, process: Child, url: str) -> None:
        self.process, self.url = process, url

    def alive(self) -> bool:
        return self.process.alive()

    def exit_note(self) -> str:
        code = self.process.poll()
        return f"process {self.process.pid} exited with code {code}" if code is not None else f"process {self.process.pid} not answering"

    def stop(self) -> None:
        self.process.stop(timeout_s=10.0)


def shared_machine_config(config: Any) -> Any:
    """The config each of ``rollout.engines`` local engines starts with: when the KV cache is sized
    from free memory (``engine.kv_cache_tokens`` null), each engine gets ``kv_memory_fraction / N``
    of it, so N engines on one machine take about what one would, not N times 30% of it (four
    SmolLM2 engines on a 24 GB machine were killed for memory)."""
    from dataclasses import replace

    engines = config.rollout.engines
    if engines <= 1 or config.engine.kv_cache_tokens is not None:
        return config
    return replace(config, engine=replace(config.engine, kv_memory_fraction=config.engine.kv_memory_fraction / engines))


def shared_machine_threads(config: Any) -> int | None:
    """Torch threads of each of ``rollout.engines`` local CPU engines: the machine's cores divided
    among them (at least 1), since they generate at the same time; N engines with all cores each
    oversubscribe them (OpenMP threads spinning against each other: two engines on 2 cores gave fewer
    tokens/s than one, and four committing a push at once took 4x as long). None (as this process)
    for one engine or a CUDA one; ``OMP_NUM_THREADS`` set here wins (``start_engine_server``)."""
    import os

    from noria.engine.child import engine_device

    if config.rollout.engines <= 1 or not engine_device(config).startswith("cpu"):
        return None
    return max(1, len(os.sched_getaffinity(0)) // config.rollout.engines)


def start_local_engine(config: Any, folder: Path, api_key: str) -> Callable[[int], LocalEngineProc]:
    """``start(index)`` for a fleet of local ``noria serve`` children (logs: engine-<index>.log),
    sharing the machine's memory (``shared_machine_config``) and cores (``shared_machine_threads``)."""
    from noria.engine.child import start_engine_server
    from noria.models.catalog import model_path

    engine_config, threads = shared_machine_config(config), shared_machine_threads(config)

    def start(index: int) -> LocalEngineProc:
        process, url, _ = start_engine_server(model_path(config.model.path), engine_config, folder, api_key=api_key,
                                              log_name=f"engine-{index}.log", threads=threads)  # fmt: skip
        return LocalEngineProc(process, url)

    return start
