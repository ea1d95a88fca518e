"""Futures and the fair scheduler: every call runs on one worker thread, tenants take turns.

A route validates its request, is admitted by the tenant's quotas (``TenantRegistry.admit``), and
``submit`` queues the work on the tenant's own queue; the answer is a ``request_id`` at once
(Tinker's futures). The worker thread runs one call at a time, visiting tenants round-robin: a
tenant with 10 queued calls and one with 1 alternate, so no tenant waits behind another's backlog.
Calls of one tenant run in the order they were sent. The model and its adapters are touched by this
thread only, so the training code needs no lock.

``retrieve`` answers a future of the calling tenant: pending, done (the result) or failed (the
error); a future of another tenant is ``NotFound``, as is one never made. Finished futures are kept
until ``KEEP`` more have finished (then the oldest go): a client retrieving late may find its
future gone.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from noria.service.state import NotFound
from noria.service.tenants import Tenant, TenantRegistry

KEEP = 4096
"""Finished futures kept for retrieval."""


@dataclass
class Future:
    tenant: str
    kind: str
    state: str = "pending"
    """pending, done or failed."""
    result: Any = None
    error: BaseException | None = None


class Scheduler:
    """Per-tenant queues drained round-robin by one worker thread."""

    def __init__(self, registry: TenantRegistry) -> None:
        self.registry = registry
        self.queues: dict[str, deque] = {}
        self.turns: deque[str] = deque()
        self.futures: OrderedDict[str, Future] = OrderedDict()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="noria-service-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    def submit(self, tenant: Tenant, kind: str, work: Callable[[], Any], tokens: int = 0) -> str:
        """Queue ``work`` for ``tenant`` (``QuotaExceeded`` if its quotas refuse); the future's id."""
        self.registry.admit(tenant, tokens)
        request_id = f"{kind}-{uuid.uuid4().hex}"
        with self._cond:
            self.futures[request_id] = Future(tenant=tenant.name, kind=kind)
            queue = self.queues.setdefault(tenant.name, deque())
            if not queue and tenant.name not in self.turns:
                self.turns.append(tenant.name)
            queue.append((request_id, tenant, work))
            self._cond.notify_all()
        return request_id

    def retrieve(self, tenant: Tenant, request_id: str) -> Future:
        with self._cond:
            future = self.futures.get(request_id)
        if future is None or future.tenant != tenant.name:
            raise NotFound(f"future {request_id!r}: no such request of tenant {tenant.name}")
        return future

    def _next(self) -> tuple[str, Tenant, Callable[[], Any]] | None:
        """The next call: the head of the tenant whose turn it is (under the condition's lock)."""
        while self.turns:
            name = self.turns.popleft()
            queue = self.queues[name]
            if queue:
                item = queue.popleft()
                if queue:
                    self.turns.append(name)  # back of the line, behind the other tenants
                return item
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                item = self._next()
                while item is None and not self._stop:
                    self._cond.wait()
                    item = self._next()
                if item is None:
                    return
            request_id, tenant, work = item
            try:
                result, error = work(), None
            except Exception as e:  # noqa: BLE001 -- the call's failure is its future's answer
                result, error = None, e
            self._finish(request_id, tenant, result, error)

    def _finish(self, request_id: str, tenant: Tenant, result: Any, error: BaseException | None) -> None:
        with self._cond:
            future = self.futures[request_id]
            future.state, future.result, future.error = ("failed" if error else "done"), result, error
            done = [k for k, f in self.futures.items() if f.state != "pending"]
            for k in done[: max(0, len(done) - KEEP)]:
                del self.futures[k]
        self.registry.done(tenant)
