"""Futures and the fair scheduler: every call runs on one worker thread, tenants take turns.

A route validates its request, is admitted by the tenant's quotas (``TenantRegistry.admit``), and
``submit`` queues the work on the tenant's own queue; the answer is a ``request_id`` at once
(Tinker's futures). The worker thread visits tenants round-robin: a tenant with 10 queued calls
and one with 1 alternate, so no tenant waits behind another's backlog. Calls of one tenant run in
the order they were sent.

Batching: a call submitted with a ``batch`` payload (forward, forward_backward) is taken together
with the BATCHABLE head calls of the other tenants, in turn order, up to ``batch_tokens`` tokens,
and all of them run as one ``run_batch(payloads)`` (every tenant's rows through the model together,
each with its own adapter, in micro-batches: ``noria.service.step.run_calls``); each gets its own result or error. A tenant
contributes at most one call to a batch, so its calls still run one after another. Other calls
(optim_step, save, load, sample, ...) run alone. A call whose work returns a
``concurrent.futures.Future`` (sample: the engine generates on its own thread) is finished when
that future is, and the worker goes on meanwhile. The model and its adapters are touched by this
thread only, so the training code needs no lock.

``retrieve`` answers a future of the calling tenant: pending, done (the result) or failed (the
error); a future of another tenant is ``NotFound``, as is one never made. Finished futures are kept
until ``KEEP`` more have finished (then the oldest go): a client retrieving late may find its
future gone.
"""

from __future__ import annotations

import concurrent.futures
import threading
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from noria.service.state import NotFound
from noria.service.tenants import Tenant, TenantRegistry

KEEP = 4096
"""Finished futures kept for retrieval."""


@dataclass
class _Item:
    request_id: str
    tenant: Tenant
    work: Callable[[], Any] | None
    batch: Any
    tokens: int


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

    def __init__(self, registry: TenantRegistry, run_batch: Callable[[list[Any]], list[tuple[Any, BaseException | None]]], batch_tokens: int) -> None:
        self.registry = registry
        self.run_batch = run_batch
        self.batch_tokens = batch_tokens
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

    def submit(self, tenant: Tenant, kind: str, work: Callable[[], Any] | None, tokens: int = 0, batch: Any = None) -> str:
        """Queue ``work`` (or a ``batch`` payload for ``run_batch``) for ``tenant`` (``QuotaExceeded``
        if its quotas refuse); the future's id."""
        self.registry.admit(tenant, tokens)
        request_id = f"{kind}-{uuid.uuid4().hex}"
        with self._cond:
            self.futures[request_id] = Future(tenant=tenant.name, kind=kind)
            queue = self.queues.setdefault(tenant.name, deque())
            if not queue and tenant.name not in self.turns:
                self.turns.append(tenant.name)
            queue.append(_Item(request_id, tenant, work, batch, tokens))
            self._cond.notify_all()
        return request_id

    def retrieve(self, tenant: Tenant, request_id: str) -> Future:
        with self._cond:
            future = self.futures.get(request_id)
        if future is None or future.tenant != tenant.name:
            raise NotFound(f"future {request_id!r}: no such request of tenant {tenant.name}")
        return future

    def _next(self) -> list[_Item]:
        """The next call, with the batchable heads of the other tenants if it is batchable (under
        the condition's lock); empty when nothing is queued. Tenants passed over keep their place
        ahead of those served, so none waits behind the others twice."""
        taken: list[_Item] = []
        tokens = 0
        for name in list(self.turns):
            if taken and taken[0].batch is None:
                break
            queue = self.queues[name]
            head = queue[0] if queue else None
            if head is not None and (not taken or (head.batch is not None and tokens + head.tokens <= self.batch_tokens)):
                taken.append(queue.popleft())
                tokens += head.tokens
        served = [i.tenant.name for i in taken]
        order = [n for n in self.turns if n not in served] + served
        self.turns = deque(n for n in order if self.queues[n])
        return taken

    def _run(self) -> None:
        while True:
            with self._cond:
                items = [] if self._stop else self._next()
                while not items and not self._stop:
                    self._cond.wait()
                    items = self._next()
                if self._stop:  # queued calls are dropped: a stopping service answers no more futures
                    return
            for item, (result, error) in zip(items, self._outcomes(items)):
                if isinstance(result, concurrent.futures.Future):  # runs on elsewhere (the engine): finish when it does
                    result.add_done_callback(partial(self._finish_later, item))
                else:
                    self._finish(item.request_id, item.tenant, result, error)

    def _finish_later(self, item: _Item, done: concurrent.futures.Future) -> None:
        error = done.exception()
        self._finish(item.request_id, item.tenant, None if error else done.result(), error)

    def _outcomes(self, items: list[_Item]) -> list[tuple[Any, BaseException | None]]:
        if items[0].batch is not None:
            try:
                return self.run_batch([i.batch for i in items])
            except Exception as e:  # noqa: BLE001 -- the batch's failure is each of its futures' answer
                return [(None, e)] * len(items)
        try:
            return [(items[0].work(), None)]
        except Exception as e:  # noqa: BLE001 -- the call's failure is its future's answer
            return [(None, e)]

    def _finish(self, request_id: str, tenant: Tenant, result: Any, error: BaseException | None) -> None:
        with self._cond:
            future = self.futures[request_id]
            future.state, future.result, future.error = ("failed" if error else "done"), result, error
            done = [k for k, f in self.futures.items() if f.state != "pending"]
            for k in done[: max(0, len(done) - KEEP)]:
                del self.futures[k]
        self.registry.done(tenant)
