"""The engine fleet: ``rollout.engines`` ``noria serve`` engines behind the real sglang-router (the
client rollout uses to reach them is ``noria.launch.fleet_client.FleetClient``, an ``EngineClient``).

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
current version to it and calls ``rejoin``), ``retired`` (dead with no restarts left); and, for an
elastic fleet (``noria.launch.elastic``), ``joining`` (an engine added to the running fleet: like
``restarted``, out of rotation until the current weights are pushed to it and verified),
``draining`` (leaving: out of the router at once, its admitted requests finishing) and ``removed``
(gone; neither a failure nor a restart).

Leaving (``begin_drain``): an engine removed by ``noria fleet remove`` (it leaves the router, then
gets SIGTERM), or one that got SIGTERM from elsewhere (preemption). ``noria serve`` then answers 503
while it drains (``rollout.engine_drain_s``), aborts what is left, closes its port and exits 0. The
watcher thread (``watch``, every ``WATCH_S``) asks each serving engine for its load: a 503, a refused
connection while its process runs, or an exit with code 0 means it is leaving; it leaves the router
at once, and a thread waits for its process to end (SIGKILL ``STOP_S`` after the drain) and marks it
``removed``, unless it ended other than with code 0: a crash, then ``lost`` as any death. A request
that fails on a leaving engine (sent before the router dropped it) or that its drain aborted raises
``EngineLost``, and its group is generated again on the others (``fleet/requests_moved``; see
``noria.launch.fleet_client``). The last engine leaving clears ``ready``: the job starts another.

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
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from noria.engine.child import ready_all
from noria.process import Child
from noria.rollout import EngineFailure, HttpEngineClient

WATCH_S = 0.1
"""How often the watcher asks each serving engine whether it is draining (SIGTERM from outside)."""
STOP_S = 30.0
"""How long a leaving engine may take to exit after its drain (``drain_s``: it aborts what is left
and stops) before it is killed."""


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
    left_note: str = ""
    """Why it left the fleet (``removed by noria fleet remove``, ``preempted``)."""
    on_gone: Callable[[Slot], None] | None = None
    """Called once its process has ended after it left (the answer to ``noria fleet remove``)."""

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
    added: int = 0
    leaving: int = 0
    """Engines that began to leave (removed or preempted): a request that fails or is aborted after
    this grew while it ran is moved to the other engines."""
    removed: int = 0
    moved: int = 0
    changes: int = 0
    """Changes of the fleet's members (a restart, an engine added or gone): the job's weight syncs
    to the old set of engines are dropped when it moved."""


def wait_gone(proc: Any, timeout_s: float) -> None:
    """Until ``proc`` has ended by itself; stopped after ``timeout_s``."""
    process = getattr(proc, "process", None)
    try:
        if process is not None:
            process.wait(timeout_s)
            return
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + timeout_s
    while process is None and proc.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.stop()


def exited_cleanly(proc: Any) -> bool:
    """Whether an engine's process ended with code 0: ``noria serve`` does so only after a drain."""
    process = getattr(proc, "process", None)
    return process is not None and process.poll() == 0


class EngineFleet:
    """``n`` engines started by ``start(index)``, a router for n > 1. ``start`` launches engine ``index``
    and returns at once a start whose ``ready()`` waits for it (``EngineProc``) and whose ``stop()``
    abandons it (``noria.engine.child.StartingEngine``)."""

    def __init__(self, start: Callable[[int], Any], n: int, api_key: str, restarts: int, timeout_s: float, folder: Path,
                 drain_s: float = 30.0) -> None:  # fmt: skip
        self.start_engine, self.n, self.api_key = start, n, api_key
        self.max_restarts, self.timeout_s, self.folder, self.drain_s = restarts, timeout_s, folder, drain_s
        self.slots: list[Slot] = []
        self.router: Any = None
        self.counters = FleetCounters()
        self.spawner = ThreadPoolExecutor(1, thread_name_prefix="noria-fleet-spawn")
        """Restarts start engines from this one thread, which lives as long as the fleet: a child dies with
        the thread that started it (``noria.process.lifecycle``), and the job's worker threads come and go."""
        self.dead_urls: set[str] = set()
        """URLs of engines found dead (a request the router sent there before it dropped them fails naming one)."""
        self.gone_urls: set[str] = set()
        """URLs of engines that left (drained), likewise."""
        self.on_event: Callable[..., None] = lambda event, slot, **fields: None
        """``(event, slot, **fields)`` at each change of an engine (the job records them: ``noria.launch.elastic``)."""
        self._ready: asyncio.Event | None = None
        self._marking = threading.Lock()
        self._closing = threading.Event()
        self.watcher: threading.Thread | None = None
        self.prober = ThreadPoolExecutor(8, thread_name_prefix="noria-fleet-probe")
        self.needs_engine = False
        """The last engine in rotation left (removed or preempted): the job adds one at its next safe point."""

    def start(self) -> EngineFleet:
        """Start every engine, then the router in front of them. All launched from this thread (a
        child dies with the thread that started it, ``noria.process.lifecycle``, so none is started
        from a short-lived pool thread), then each waited for: they load side by side. Then the
        watcher thread."""
        procs = ready_all([self.start_engine(i) for i in range(self.n)])
        self.slots = [Slot(i, p, self.client_for(p)) for i, p in enumerate(procs)]
        if self.n > 1:
            self.router = self.new_router([p.url for p in procs])
        self.watcher = threading.Thread(target=self.watch, name="noria-fleet-watch", daemon=True)
        self.watcher.start()
        return self

    def start_ready(self, index: int) -> Any:
        """Engine ``index`` started and answering (a restart, an engine added)."""
        return self.start_engine(index).ready()

    def new_router(self, urls: list[str]) -> Any:
        from noria.router.sglang_router import SglangRouter

        return SglangRouter(
            urls, api_key=self.api_key, log_path=self.folder / "router.log",
            extra_args=["--disable-retries", "--disable-circuit-breaker"],  # a failure is this client's to handle
        ).start()  # fmt: skip

    def client_for(self, proc: Any) -> HttpEngineClient:
        return HttpEngineClient(proc.url, api_key=self.api_key, timeout_s=self.timeout_s, process=getattr(proc, "process", None))

    # ---------------------------------------------------------------------------- state

    def serving(self) -> list[Slot]:
        return [s for s in self.slots if s.state == "serving"]

    def unready(self) -> list[Slot]:
        """Engines started and not yet holding the run's weights (restarted or joining)."""
        return [s for s in self.slots if s.state in ("restarted", "joining")]

    def targets(self) -> list[tuple[str, str]]:
        """(url, key) of every engine a push must reach: serving, restarted and joining ones."""
        return [(s.proc.url, self.api_key) for s in self.slots if s.state in ("serving", "restarted", "joining")]

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
        """Mark engines that died (serving ones, and restarted or joining ones not yet in rotation) as
        lost and take them out of the router; a dying process gets ``grace_s`` to show it is gone. One
        that exited with code 0 drained (preempted): it leaves, no loss. Raises ``EngineFailure``
        when none serves and none can restart (blocking; any thread)."""
        deadline = time.monotonic() + grace_s
        while True:
            lost = [s for s in self.slots if s.state in ("serving", "restarted", "joining") and not s.proc.alive()]
            if lost or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for slot in [s for s in lost if exited_cleanly(s.proc)]:
            self.begin_drain(slot, "preempted: its engine drained and exited")
        with self._marking:  # several failed requests look at once: each death is counted once
            lost = [s for s in lost if s.state in ("serving", "restarted", "joining")]
            in_router = [s for s in lost if s.state == "serving"]
            for slot in lost:
                slot.state, slot.lost_note = "lost", slot.proc.exit_note()
                slot.losses += 1
                self.counters.losses += 1
                self.dead_urls.add(slot.proc.url)
        if self.router is not None:
            for slot in in_router:
                self.router.remove_worker(slot.proc.url)
        for slot in lost:
            self.on_event("lost", slot, note=slot.lost_note)
        self.check_left()
        return lost

    def check_left(self) -> None:
        """No engine serving: ``ready`` is cleared; ``EngineFailure`` naming a dead engine when none
        may restart either (the last engine having left instead, the job starts another: ``needs_engine``)."""
        if self.serving():
            return
        self.ready_event().clear()
        if self.unready() or self.needs_engine:
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
            slot.proc = self.spawner.submit(self.start_ready, slot.index).result()
            slot.client = self.client_for(slot.proc)
            slot.restarts += 1
            slot.state = "restarted"
            self.counters.restarts += 1
            self.counters.changes += 1
            started.append(slot)
            self.on_event("restarted", slot)
        self.check_left()
        return started

    def add_engine(self) -> Slot:
        """Start one more engine (blocking), ``joining``: out of rotation until the job pushes it the
        current weights, verified, and calls ``rejoin``."""
        index = len(self.slots)
        proc = self.spawner.submit(self.start_ready, index).result()
        slot = Slot(index, proc, self.client_for(proc), state="joining")
        with self._marking:
            self.slots.append(slot)
            self.counters.added += 1
            self.counters.changes += 1
            self.needs_engine = False
        self.on_event("started", slot)
        return slot

    def rejoin(self, version: int) -> None:
        """After a push of ``version``: restarted and joining engines go (back) into rotation; every
        engine pushed to now serves ``version`` (blocking: the router registers the engines; the
        first time a second engine serves, the router is started)."""
        new = self.unready()
        urls = [s.proc.url for s in self.serving()] + [s.proc.url for s in new]
        if self.router is None and len(urls) > 1:  # from the spawner thread: the router dies with it
            self.router = self.spawner.submit(self.new_router, urls).result()
            for slot in [s for s in self.slots if s.proc.url in urls and s.state in ("draining", "removed", "lost")]:
                self.router.remove_worker(slot.proc.url)  # it left while the router started
        elif self.router is not None:
            for slot in new:
                self.router.add_worker(slot.proc.url)
        with self._marking:  # not over one that began to leave meanwhile
            for slot in self.slots:
                if slot.state in ("serving", "restarted", "joining"):
                    slot.state, slot.version = "serving", version
        for slot in new:
            self.on_event("serving", slot, version=version)

    def mark_ready(self) -> None:
        if self.serving():
            self.ready_event().set()

    # ---------------------------------------------------------------------------- leaving

    def begin_drain(self, slot: Slot, note: str, on_gone: Callable[[Slot], None] | None = None, stop: bool = False) -> bool:
        """``slot`` leaves the fleet: out of the router now; a thread waits for its process to end
        (with ``stop``, after SIGTERM: it drains for ``drain_s`` at most; SIGKILL ``STOP_S`` later) and
        marks it ``removed``. False if it was not in the fleet (blocking; any thread)."""
        seen = time.time()
        with self._marking:
            if slot.state not in ("serving", "restarted", "joining"):
                return False
            in_router = slot.state == "serving"
            slot.state, slot.left_note, slot.on_gone = "draining", note, on_gone
            self.counters.changes += 1
            self.gone_urls.add(slot.proc.url)
            self.needs_engine = not self.serving() and not self.unready()
        if in_router and self.router is not None:
            self.router.remove_worker(slot.proc.url)
        with self._marking:  # after the router let it go: a request started later cannot reach it
            self.counters.leaving += 1
        self.on_event("draining", slot, note=note, seen=seen)  # its time: out of the router
        if not self.serving():
            self.ready_event().clear()
        threading.Thread(target=self.finish_drain, args=(slot, stop), name=f"noria-fleet-drain-{slot.index}", daemon=True).start()
        return True

    def finish_drain(self, slot: Slot, stop: bool) -> None:
        """Wait for a leaving engine's process to end (stopping it with ``stop``; else it got SIGTERM
        from elsewhere), then mark it ``removed``; one not stopped here that ended other than with
        code 0 did not drain but crashed: it is ``lost`` (restarted by the job, as any death)."""
        start = time.monotonic()
        if stop:
            drain = getattr(slot.proc, "drain", None)
            drain(self.drain_s + STOP_S) if drain is not None else slot.proc.stop()
        else:
            wait_gone(slot.proc, self.drain_s + STOP_S)
        crashed = not stop and getattr(slot.proc, "process", None) is not None and not exited_cleanly(slot.proc)
        with self._marking:
            if crashed:
                slot.state, slot.lost_note = "lost", slot.proc.exit_note()
                slot.losses += 1
                self.counters.losses += 1
                self.dead_urls.add(slot.proc.url)
                self.needs_engine = False
            else:
                slot.state = "removed"
                self.counters.removed += 1
        fields = {"note": slot.lost_note if crashed else slot.left_note, "exit": slot.proc.exit_note()}
        self.on_event("lost" if crashed else "removed", slot, **fields, wait_s=round(time.monotonic() - start, 3))
        if slot.on_gone is not None:
            slot.on_gone(slot)

    def draining_now(self, slot: Slot) -> bool:
        """Whether a serving engine is leaving on its own (SIGTERM from elsewhere): it answers 503
        (``noria serve`` drains), refuses connections while its process runs (it has stopped serving
        and is exiting; ``finish_drain`` tells a crash by its exit code), or exited with code 0.
        Starts its drain if so (blocking)."""
        if slot.state != "serving":
            return slot.state in ("draining", "removed")
        try:
            answer = httpx.get(f"{slot.proc.url}/get_load", headers={"Authorization": f"Bearer {self.api_key}"}, timeout=5.0)
            # an engine that was ready answers 503 "unavailable" only while it drains
            draining = answer.status_code == 503 and answer.json().get("error", {}).get("type") == "unavailable"
        except httpx.ConnectError:
            draining = slot.proc.alive() or exited_cleanly(slot.proc)
        except (httpx.HTTPError, ValueError):  # slow to answer: busy, not leaving
            draining = False
        return draining and self.begin_drain(slot, "preempted: SIGTERM, drained")

    def find_draining(self) -> list[Slot]:
        """:meth:`draining_now` for every serving engine, asked at once (blocking)."""
        slots = self.serving()
        return [s for s, leaving in zip(slots, self.prober.map(self.draining_now, slots)) if leaving]

    def draining(self) -> list[Slot]:
        return [s for s in self.slots if s.state == "draining"]

    def watch(self) -> None:
        """The watcher thread: engines that began to drain leave the router within ``WATCH_S``."""
        from noria.router.sglang_router import RouterError

        while not self._closing.wait(WATCH_S):
            try:
                self.find_draining()
            except RouterError as e:  # the router did not drop it: its requests there fail and are moved
                self.on_event("router_error", None, note=str(e))

    async def check_versions(self, expected: int) -> None:
        """Every serving engine must serve ``expected``; ``EngineFailure`` naming the first that does not."""

        async def one(slot: Slot) -> None:
            try:
                slot.version = await slot.client.weight_version()
            except EngineFailure:
                if slot.proc.alive() and not await asyncio.to_thread(self.draining_now, slot):
                    raise
                return  # dead: found by find_lost below; draining: it left
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
            "fleet/added": float(c.added),
            "fleet/removed": float(c.removed),
            "fleet/requests_moved": float(c.moved),
        }
        c.requests = c.mixed = 0
        return out

    def close(self) -> None:
        self._closing.set()
        if self.watcher is not None:
            self.watcher.join()
        if self.router is not None:
            self.router.stop()
        for slot in self.slots:
            slot.proc.stop()
        self.spawner.shutdown(wait=False)
        self.prober.shutdown(wait=False)


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

    def drain(self, timeout_s: float) -> None:
        """SIGTERM (``noria serve`` finishes its admitted requests, aborts what outlives its
        --drain-timeout, exits 0); SIGKILL after ``timeout_s``."""
        self.process.stop(timeout_s=timeout_s)


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


def start_local_engine(config: Any, folder: Path, api_key: str) -> Callable[[int], LocalStart]:
    """``start(index)`` (a ``LocalStart``) for a fleet of local ``noria serve`` children (logs: engine-<index>.log),
    sharing the machine's memory (``shared_machine_config``) and cores (``shared_machine_threads``)."""
    from noria.engine.child import launch_engine_server
    from noria.models.catalog import model_path

    engine_config, threads = shared_machine_config(config), shared_machine_threads(config)

    def start(index: int) -> LocalStart:
        return LocalStart(launch_engine_server(model_path(config.model.path), engine_config, folder, api_key=api_key,
                                               log_name=f"engine-{index}.log", threads=threads,
                                               drain_timeout_s=config.rollout.engine_drain_s))  # fmt: skip

    return start


class LocalStart:
    """A local engine launched, not yet answering (``EngineFleet``'s start protocol)."""

    def __init__(self, starting: Any) -> None:
        self.starting = starting

    def ready(self) -> LocalEngineProc:
        process, url, _ = self.starting.ready()
        return LocalEngineProc(process, url)

    def stop(self) -> None:
        self.starting.stop()
