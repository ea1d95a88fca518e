"""Local networking helpers shared by every part that opens a port (a leaf: imports nothing of Noria).

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
