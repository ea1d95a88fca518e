"""An HTTP client for one engine or a router that never sends a session request without its key.

``RoutedClient(base_url)`` posts SGLang-native (``generate``) or OpenAI (``chat``, ``completions``)
bodies. ``client.session(key)`` returns a handle whose every request carries ``key`` in the
``x-smg-routing-key`` header; ``generate(..., session=True)`` without a key raises
``MissingRoutingKey`` before any byte is sent. Requests with ``session=False`` (the default) are
single-turn: they may carry a key, and without one the router balances them by load.

What blocks: each call awaits the whole response (no streaming here). HTTP errors raise
``httpx.HTTPStatusError`` with the server's JSON error message; nothing is retried.
"""

from __future__ import annotations

from typing import Any

import httpx

from noria.errors import NoriaError

ROUTING_HEADER = "x-smg-routing-key"
"""The header sglang-router's manual policy reads the routing key from."""


class MissingRoutingKey(NoriaError):
    """A session request has no routing key; a router would place it on a random engine."""


def routing_headers(routing_key: str | None, session: bool) -> dict[str, str]:
    """The headers that route a request; raises ``MissingRoutingKey`` for a keyless session request."""
    if routing_key is not None and (not isinstance(routing_key, str) or not routing_key):
        raise MissingRoutingKey(f"routing key must be a non-empty string, got {routing_key!r}")
    if session and not routing_key:
        raise MissingRoutingKey(
            "a session request needs a routing key (session id); without one the router would send "
            "each turn to a random engine and lose the session's cached prefix"
        )
    return {ROUTING_HEADER: routing_key} if routing_key else {}


class RoutedClient:
    """Async HTTP client for ``noria serve``, SGLang, or a router in front of them."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s, transport=transport
        )

    async def generate(self, body: dict[str, Any], routing_key: str | None = None, session: bool = False) -> Any:
        """POST ``/generate`` (SGLang native body); returns the JSON response."""
        return await self.post("/generate", body, routing_key, session)

    async def chat(self, body: dict[str, Any], routing_key: str | None = None, session: bool = False) -> Any:
        """POST ``/v1/chat/completions``."""
        return await self.post("/v1/chat/completions", body, routing_key, session)

    async def completions(self, body: dict[str, Any], routing_key: str | None = None, session: bool = False) -> Any:
        """POST ``/v1/completions``."""
        return await self.post("/v1/completions", body, routing_key, session)

    async def post(self, path: str, body: dict[str, Any], routing_key: str | None, session: bool) -> Any:
        headers = routing_headers(routing_key, session)  # raises before anything is sent
        response = await self.http.post(path, json=body, headers=headers)
        if response.is_error:
            raise httpx.HTTPStatusError(
                f"{path} answered {response.status_code}: {response.text}", request=response.request, response=response
            )
        return response.json()

    def session(self, routing_key: str) -> SessionClient:
        """A handle for one session: every request carries ``routing_key``."""
        routing_headers(routing_key, session=True)
        return SessionClient(self, routing_key)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> RoutedClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


class SessionClient:
    """The requests of one session, all routed by the same key."""

    def __init__(self, client: RoutedClient, routing_key: str) -> None:
        self.client, self.routing_key = client, routing_key

    async def generate(self, body: dict[str, Any]) -> Any:
        return await self.client.generate(body, self.routing_key, session=True)

    async def chat(self, body: dict[str, Any]) -> Any:
        return await self.client.chat(body, self.routing_key, session=True)

    async def completions(self, body: dict[str, Any]) -> Any:
        return await self.client.completions(body, self.routing_key, session=True)
