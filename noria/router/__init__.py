"""Routing requests to engines: session affinity by routing key, load-based for single turns.

Semantics (the same in every implementation here, and those of sglang-router's ``manual`` policy
with ``--assignment-mode min_load``):

- A request of a session carries a routing key. The first request of a key goes to the engine with
  the fewest requests in flight (as counted by the router); every later request of that key goes to
  the same engine, so the session's prefix stays in that engine's cache.
- A session request WITHOUT a key is an error raised before anything is sent (``MissingRoutingKey``);
  sglang-router would route it at random, which silently destroys cache locality.
- Single-turn requests may go without a key; they go to the least loaded engine.

Modules:

- ``client``: ``RoutedClient``, an HTTP client for an engine or a router that enforces the rule above
  and sends the key in the ``x-smg-routing-key`` header.
- ``local``: ``LocalRouter``, the in-process router for engines in this process (one engine in the
  common case), with the same semantics.
- ``sglang_router``: ``SglangRouter``, starts and stops the real ``sglang-router`` (a Rust binary
  from PyPI) as a subprocess in front of several ``noria serve`` engines.
"""

from noria.router.client import ROUTING_HEADER, MissingRoutingKey, RoutedClient
from noria.router.local import LocalRouter

__all__ = ["ROUTING_HEADER", "LocalRouter", "MissingRoutingKey", "RoutedClient"]
