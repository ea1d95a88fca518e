"""Tenants of ``noria service``: who a key belongs to, and the quotas each tenant is held to.

A tenant is a name, an API key (sent as ``X-API-Key``, as Tinker's SDK sends it) and three quotas:

- ``max_adapters``: training clients (LoRA adapters) held at once; one more is refused;
- ``tokens_per_minute``: tokens sent to ``forward_backward`` plus tokens asked of ``sample`` in any
  sliding 60 s window; a call that would pass it is refused with the seconds until it would fit;
- ``queue_depth``: the tenant's calls waiting or running at once.

A refusal is a ``QuotaExceeded`` (HTTP 429 with ``Retry-After``). Keys come from a YAML or JSON
keys file (``service.keys_file``), or, without one, a single tenant ``default`` gets a key generated
at start. Keys are compared in constant time. The registry is used from the server's event loop and
the worker thread, so every count sits under one lock.

Not guaranteed: the token window is per process (a restarted service forgets it), and keys are
kept in memory in the clear (protect the keys file as you would any password file).
"""

from __future__ import annotations

import hmac
import json
import re
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from noria.config import ServiceSection
from noria.errors import NoriaError

WINDOW_S = 60.0
"""The token quota's sliding window."""
KEY_PREFIX = "tml-"
"""Generated keys start with Tinker's key prefix, so a key pasted into Tinker tooling is accepted by it."""


class QuotaExceeded(NoriaError):
    """A call refused by a quota: HTTP 429 with ``Retry-After: retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class Tenant:
    """One tenant: its key, its quotas and what it uses now."""

    name: str
    key: str
    max_adapters: int
    tokens_per_minute: int
    queue_depth: int
    adapters: int = 0
    """Training clients held now."""
    queued: int = 0
    """Calls waiting or running now."""
    spent: deque = field(default_factory=deque)
    """(monotonic time, tokens) of the calls in the last ``WINDOW_S``."""


class TenantRegistry:
    """The tenants by key, and the quota checks; thread-safe."""

    def __init__(self, tenants: list[Tenant]) -> None:
        names = [t.name for t in tenants]
        if len(set(names)) != len(names) or len({t.key for t in tenants}) != len(tenants):
            raise NoriaError(f"tenants: names and keys must be unique, got names {names}")
        self.tenants = {t.name: t for t in tenants}
        self._lock = threading.Lock()

    def authenticate(self, key: str) -> Tenant | None:
        """The tenant whose key this is, else None (every key compared, in constant time)."""
        found = None
        for tenant in self.tenants.values():
            if hmac.compare_digest(tenant.key.encode(), key.encode()):
                found = tenant
        return found

    def take_adapter(self, tenant: Tenant) -> None:
        """Count one more adapter, or raise ``QuotaExceeded`` (retry once one is unloaded)."""
        with self._lock:
            if tenant.adapters >= tenant.max_adapters:
                raise QuotaExceeded(f"tenant {tenant.name}: {tenant.adapters} adapters held, quota max_adapters is {tenant.max_adapters}", 60.0)
            tenant.adapters += 1

    def release_adapter(self, tenant: Tenant) -> None:
        with self._lock:
            tenant.adapters = max(0, tenant.adapters - 1)

    def admit(self, tenant: Tenant, tokens: int, now: float | None = None) -> None:
        """Count a call into the queue and its tokens into the window, or raise ``QuotaExceeded``."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if tenant.queued >= tenant.queue_depth:
                raise QuotaExceeded(f"tenant {tenant.name}: {tenant.queued} calls queued, quota queue_depth is {tenant.queue_depth}", 1.0)
            while tenant.spent and tenant.spent[0][0] <= now - WINDOW_S:
                tenant.spent.popleft()
            used = sum(n for _, n in tenant.spent)
            if tokens > tenant.tokens_per_minute:
                raise QuotaExceeded(f"tenant {tenant.name}: one call of {tokens} tokens is over tokens_per_minute {tenant.tokens_per_minute}", WINDOW_S)
            if used + tokens > tenant.tokens_per_minute:
                raise QuotaExceeded(
                    f"tenant {tenant.name}: {used} tokens in the last minute + {tokens} is over tokens_per_minute {tenant.tokens_per_minute}",
                    _retry_after(tenant.spent, used + tokens - tenant.tokens_per_minute, now),
                )
            tenant.spent.append((now, tokens))
            tenant.queued += 1

    def done(self, tenant: Tenant) -> None:
        """A call admitted by ``admit`` has ended (resolved or failed)."""
        with self._lock:
            tenant.queued = max(0, tenant.queued - 1)


def _retry_after(spent: deque, excess: int, now: float) -> float:
    """Seconds until at least ``excess`` tokens have left the window (at least 1)."""
    freed = 0
    for at, n in spent:
        freed += n
        if freed >= excess:
            return max(1.0, at + WINDOW_S - now)
    return WINDOW_S


def load_tenants(cfg: ServiceSection) -> tuple[TenantRegistry, str | None]:
    """The registry of ``cfg.keys_file``, or of one generated tenant; the generated key, if any."""
    if not cfg.keys_file:
        key = KEY_PREFIX + secrets.token_urlsafe(24)
        return TenantRegistry([_tenant("default", {"key": key}, cfg, "generated")]), key
    path = Path(cfg.keys_file)
    if not path.is_file():
        raise NoriaError(f"service.keys_file {path}: no such file")
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if not isinstance(data, dict) or not isinstance(data.get("tenants"), dict) or not data["tenants"]:
        raise NoriaError(f"service.keys_file {path}: needs a non-empty mapping 'tenants: {{NAME: {{key: KEY}}}}'")
    return TenantRegistry([_tenant(str(name), entry, cfg, f"{path}: tenants.{name}") for name, entry in data["tenants"].items()]), None


QUOTAS = ("max_adapters", "tokens_per_minute", "queue_depth")


def _tenant(name: str, entry: object, cfg: ServiceSection, where: str) -> Tenant:
    """One tenant from its keys-file entry; quotas it leaves out are the section's defaults."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", name):
        raise NoriaError(f"{where}: a tenant's name is letters, digits, '_' and '-' (it names its folder of saved states)")
    if not isinstance(entry, dict) or not isinstance(entry.get("key"), str) or len(entry["key"]) < 16:
        raise NoriaError(f"{where}: needs 'key', a string of at least 16 characters")
    unknown = sorted(set(entry) - {"key", *QUOTAS})
    if unknown:
        raise NoriaError(f"{where}: unknown fields {unknown}; known: key, {', '.join(QUOTAS)}")
    quotas = {q: entry.get(q, getattr(cfg, q)) for q in QUOTAS}
    for q, v in quotas.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise NoriaError(f"{where}.{q}: must be an integer >= 1, got {v!r}")
    return Tenant(name=name, key=entry["key"], **quotas)
