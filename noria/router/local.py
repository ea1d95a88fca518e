"""The in-process router: sglang-router's manual policy (min_load assignment) over local engines.

``LocalRouter(engines)`` takes objects with ``async generate(GenerateRequest) -> GenerateOutput``
(the built-in ``Engine``, or any client with that method). ``await router.generate(req, session=...)``
picks the engine by ``req.routing_key``: a known key goes where it went before; a new key, or a
single-turn request without one, goes to the engine with the fewest requests in flight through
this router (ties: lowest index). A session request without a key raises ``MissingRoutingKey``
before any engine sees it. With one engine every request goes to it, but the key rule still holds,
so code written against one engine keeps working behind the real router.

Not guaranteed: keys are kept until ``forget(key)`` or until ``max_keys`` is exceeded (then the
least recently used key is dropped, as sglang-router evicts idle keys); load counts only requests
sent through this router.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any

from noria.engine.protocol import GenerateOutput, GenerateRequest
from noria.router.client import routing_headers


class LocalRouter:
    """Session-affine, load-balanced routing over engines in this process."""

    def __init__(self, engines: Sequence[Any], max_keys: int = 100_000) -> None:
        if not engines:
            raise ValueError("LocalRouter needs at least one engine")
        self.engines = list(engines)
        self.inflight = [0] * len(self.engines)
        self.max_keys = max_keys
        self.assignment: OrderedDict[str, int] = OrderedDict()

    def pick(self, routing_key: str | None, session: bool = False) -> int:
        """Index of the engine for a request (records a new key's assignment)."""
        routing_headers(routing_key, session)  # the same refusal as the HTTP client
        if routing_key is None:
            return self._least_loaded()
        if routing_key in self.assignment:
            self.assignment.move_to_end(routing_key)
            return self.assignment[routing_key]
        index = self._least_loaded()
        self.assignment[routing_key] = index
        if len(self.assignment) > self.max_keys:
            self.assignment.popitem(last=False)
        return index

    async def generate(self, req: GenerateRequest, session: bool = False) -> GenerateOutput:
        index = self.pick(req.routing_key, session)
        self.inflight[index] += 1
        try:
            return await self.engines[index].generate(req)
        finally:
            self.inflight[index] -= 1

    async def stream(self, req: GenerateRequest, session: bool = False) -> AsyncIterator[GenerateOutput]:
        index = self.pick(req.routing_key, session)
        self.inflight[index] += 1
        try:
            async for part in self.engines[index].stream(req):
                yield part
        finally:
            self.inflight[index] -= 1

    def forget(self, routing_key: str) -> None:
        """Drop a finished session's assignment."""
        self.assignment.pop(routing_key, None)

    def _least_loaded(self) -> int:
        return min(range(len(self.engines)), key=lambda i: (self.inflight[i], i))
