"""``FleetClient``: the ``EngineClient`` rollout uses over an engine fleet (``noria.launch.fleet``).

Generation goes through the fleet's router (or its one engine, before a router exists); control calls
(pause, resume, memory) fan out to every serving engine. A request that fails is classified here:

- an engine left the fleet meanwhile (``left_meanwhile``: it began to drain since the request
  started, or is draining now; each serving engine is asked), or the response was aborted by a
  drain: ``EngineLost``, its group generated again on
  the others (``fleet/requests_moved``);
- an engine died meanwhile (``EngineFleet.find_lost``): ``EngineLost`` as well, the engine restarted
  by the job;
- neither: the failure is the request's own and stops the run (``EngineFailure``).

Every ``EngineLost`` waits for ``ready`` (an engine serving) before its group starts over.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from noria.rollout import EngineFailure, HttpEngineClient
from noria.rollout.scheduler import EngineLost

if TYPE_CHECKING:
    from noria.launch.fleet import EngineFleet


class FleetClient:
    """The ``EngineClient`` rollout uses over a fleet: generation through the router (or the one
    engine), control calls fanned out to every serving engine."""

    def __init__(self, fleet: EngineFleet) -> None:
        self.fleet = fleet
        self.name = "engine fleet"
        self.clients: dict[str, HttpEngineClient] = {}

    @property
    def router_client(self) -> HttpEngineClient | None:
        """The router's client, once the fleet has a router (it starts with 2 engines, or on the first add)."""
        router = self.fleet.router
        if router is None:
            return None
        if router.url not in self.clients:
            self.clients[router.url] = HttpEngineClient(router.url, api_key=self.fleet.api_key, timeout_s=self.fleet.timeout_s)
        return self.clients[router.url]

    async def generate(self, req: Any) -> Any:
        fleet = self.fleet
        await fleet.wait_ready()
        mixed, losses, leaving = fleet.mixed, fleet.counters.losses, fleet.counters.leaving
        client = self.router_client
        if client is None:
            serving = fleet.serving()
            if not serving:  # the last one left since ``ready`` was set (the watcher's thread)
                raise EngineLost("no engine serving: the last one left; the group waits for another", fleet.wait_ready)
            client = serving[0].client
        try:
            out = await client.generate(req)
        except EngineFailure as e:
            if await self.left_meanwhile(leaving) or any(url in str(e) for url in fleet.gone_urls):
                raise self.moved(e) from e
            await fleet.find_lost()
            if fleet.counters.leaving > leaving:  # it exited (code 0) before it was seen draining
                raise self.moved(e) from e
            dead = [url for url in fleet.dead_urls if url in str(e)]  # the router names the worker it could not reach
            lost = [s for s in fleet.slots if s.losses > 0] if fleet.counters.losses > losses or dead else []
            if not lost:  # no engine died or left while it ran: a failure of its own, which stops the run
                raise
            names = ", ".join(f"{s.name} ({s.lost_note})" for s in lost)
            raise EngineLost(f"{names} died under a request; its group is regenerated", fleet.wait_ready) from e
        if (out.finish_reason or {}).get("type") == "abort" and await self.left_meanwhile(leaving):
            raise self.moved(None)  # its engine's drain aborted it (before the watcher saw it, maybe)
        fleet.counters.requests += 1
        fleet.counters.mixed += int(mixed or fleet.mixed)
        return out

    async def left_meanwhile(self, leaving: int) -> bool:
        """Whether an engine began to leave since the fleet's count of leaving engines was ``leaving``,
        or is leaving now (each serving engine is asked)."""
        fleet = self.fleet
        if fleet.counters.leaving == leaving and not fleet.draining():
            await asyncio.to_thread(fleet.find_draining)
        return fleet.counters.leaving > leaving or bool(fleet.draining())

    def moved(self, error: BaseException | None) -> EngineLost:
        """A request that an engine leaving the fleet did not finish: its group goes to the others."""
        fleet = self.fleet
        fleet.counters.moved += 1
        names = ", ".join(f"{s.name} ({s.left_note})" for s in fleet.slots if s.state in ("draining", "removed"))
        why = f": {error}" if error is not None else " (aborted by its drain)"
        return EngineLost(f"a request on an engine leaving the fleet failed{why}; left: {names}; its group is regenerated", fleet.wait_ready)

    async def fan_out(self, call: Callable[[HttpEngineClient], Any]) -> None:
        """``call`` on every serving engine; a failure of an engine found dead or draining is left to find_lost."""
        slots = self.fleet.serving()
        results = await asyncio.gather(*(call(s.client) for s in slots), return_exceptions=True)
        for slot, result in zip(slots, results):
            if isinstance(result, BaseException) and await asyncio.to_thread(slot.proc.alive):
                if not await asyncio.to_thread(self.fleet.draining_now, slot):
                    raise result
        await self.fleet.find_lost(grace_s=0.0)

    async def pause(self, mode: str = "retract") -> None:
        await self.fan_out(lambda c: c.pause(mode))

    async def resume(self) -> None:
        await self.fan_out(lambda c: c.resume())

    async def release_memory(self, weights: bool = False) -> None:
        await self.fan_out(lambda c: c.release_memory(weights))

    async def resume_memory(self) -> None:
        await self.fan_out(lambda c: c.resume_memory())

    async def weight_version(self) -> int:
        return min(await asyncio.gather(*(s.client.weight_version() for s in self.fleet.serving())))

    async def aclose(self) -> None:
        for slot in self.fleet.slots:
            await slot.client.aclose()
        for client in self.clients.values():
            await client.aclose()
