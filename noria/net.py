"""Local networking helpers shared by every part that opens a port (a leaf: imports nothing of Noria).

``deflate_body`` is how Noria's aiohttp servers (``noria serve``, the session server, ``noria
service``) tell a body they refuse unread (see its docstring).

``free_port`` is how the engine server started by a run, the weight-sync rendezvous, the router,
the SFT runner's ranks and the benchmarks pick a port. Loopback by default: every Noria server and
rendezvous binds 127.0.0.1 unless told otherwise.

Not guaranteed: the port is free when this returns, not when the caller binds it (another process
may take it in between; callers that cannot retry bind it themselves and pass the socket on, as the
weight-sync store does).
"""

from __future__ import annotations

import socket
import threading


_HANDED_OUT: set[tuple[str, int]] = set()
_HANDED_OUT_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``host`` (loopback by default), never one this process was
    given before: servers launched together (an engine fleet) bind their ports only seconds later,
    and the OS may report the same free port twice meanwhile."""
    for _ in range(100):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        with _HANDED_OUT_LOCK:
            if (host, port) not in _HANDED_OUT:
                _HANDED_OUT.add((host, port))
                return port
    raise OSError(f"no free TCP port on {host} that this process was not given before")


def on_this_machine(url: str) -> bool:
    """Whether a server URL is on this machine: loopback, or this node's address (``node_address``)."""
    from urllib.parse import urlparse

    host = urlparse(url).hostname or ""
    return host in ("127.0.0.1", "localhost", "::1") or host == node_address()


def node_address() -> str:
    """The address other machines reach this one at: ``NORIA_NODE_ADDRESS`` when set (the Ray
    launcher sets it to the node's Ray address), else 127.0.0.1 (one machine: loopback only)."""
    import os

    return os.environ.get("NORIA_NODE_ADDRESS", "127.0.0.1")


DEFLATE_REFUSED = "Content-Encoding deflate is not accepted: send the body as it is, or gzip it"
"""The message of the 415 answer to a deflate-encoded body (``deflate_body``)."""


def deflate_body(headers) -> bool:
    """Whether a request's headers send its body ``Content-Encoding: deflate``, which every Noria
    aiohttp server answers 415 before anything reads the body, closing the connection after it.

    Why: aiohttp (3.14) decodes deflate as the body arrives and raises at its end when the stream is
    cut short; when that end comes in a later packet than the headers, the error reaches neither the
    handler reading the body nor the client, and the request is never answered (reproduced on
    ``noria serve``: 61 of 80 concurrent POSTs of a 2-byte body; on the session server 18 of 48 were
    disconnected unanswered). gzip, which no such end check stops, is still decoded. The connection
    is closed after the answer because aiohttp would otherwise wait on the unread body before
    reading the next request on it."""
    return "deflate" in headers.get("Content-Encoding", "").lower()
