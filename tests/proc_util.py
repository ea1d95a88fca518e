"""Helpers for tests that watch real processes: what a process listens on, its descendants, whether
a pid is gone. Reads ``/proc`` (Linux)."""

from __future__ import annotations

import ipaddress
import os
import time
from pathlib import Path


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _address(hex_addr: str) -> str:
    """``/proc/net/tcp`` notation (little-endian words) as an IP address string."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket of ``pid`` in LISTEN state, IPv4 and IPv6."""
    inodes = socket_inodes(pid)
    return [(address, port) for address, port, inode in listening_sockets() if inode in inodes]


def listening_sockets() -> list[tuple[str, int, str]]:
    """(address, port, socket inode) of every TCP socket in LISTEN state on this machine. The inode
    names one socket: a port that another process binds later has the same number, not the same inode."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == "0A":  # TCP_LISTEN
                host, port = local.split(":")
                out.append((_address(host), int(port, 16), inode))
    return out


def beyond_loopback(addresses: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The (address, port) pairs not on a loopback address (0.0.0.0 and :: are all interfaces)."""
    return [(a, p) for a, p in addresses if not ipaddress.ip_address(a).is_loopback]


def children(pid: int) -> list[int]:
    """Direct children of ``pid``."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(p.name))
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``."""
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until none of ``pids`` is alive; return those still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]
