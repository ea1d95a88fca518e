"""``WeightSync``: one push of the trainer's weights to every engine, checked, timed and verified.

A push, whatever the transport::

    buckets ─▶ check each tensor against every engine's specs (name, shape, dtype; no duplicates)
            ─▶ transport.send: every bucket is staged on every engine (the engines keep serving
               their old weights), then every engine commits the update as ``version``
            ─▶ verify (``sync.verify``): every engine reports ``version`` and, for every tensor
               sent, a checksum equal to the trainer's tensor cast to the engine's dtype

A failure anywhere before the commits discards the staged parts on every engine, so no engine
changes; see :class:`Transport` for what the commits themselves guarantee.

Metrics of a push: ``sync/seconds`` (the push without the verification work), ``sync/bytes`` (bytes
of the tensors in the engines' dtype, counted once however many engines), ``sync/gb_per_s`` (bytes / seconds, 1e9),
``sync/tensors``, and ``sync/verify_seconds`` (hashing the trainer's tensors plus asking the engines)
when verifying.

Blocking: ``push`` blocks until every engine has committed (and verified); run it in a thread from
async code. One push at a time per ``WeightSync``.
"""

from __future__ import annotations

import concurrent.futures
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from noria.errors import NoriaError
from noria.models.checkpoint import Bucket
from noria.sync.errors import WeightSyncError
from noria.sync.targets import HttpEngine, LocalTarget, Specs



class Transport:
    """How bytes reach the engines. ``send`` stages every bucket on every target and then commits
    ``version`` on each; ``abort`` discards what a failed ``send`` staged (best effort).

    Not guaranteed across engines: commits go to all engines at once, and if one engine refuses its
    commit (it died, or its staged update was replaced meanwhile) the others may already serve the
    new version; the error names the engine that failed."""

    name = "?"

    def __init__(self, targets: list[Any], pool: concurrent.futures.ThreadPoolExecutor) -> None:
        self.targets = targets
        self.pool = pool
        self.push_metrics: dict[str, float] = {}
        """Figures of the last push that only this transport knows (the disk transport's bytes
        written, a delta's changed fraction); ``WeightSync.push`` adds them to its metrics."""

    @property
    def casts_on_write(self) -> bool:
        """Whether every tensor reaches every engine through a copy that casts it to the engine's
        dtype (then the trainer may give its fp32 masters as they are: no cast copy of its own)."""
        return False

    def send(self, buckets: Iterator[Bucket], version: int, update_id: str) -> None:
        raise NotImplementedError

    def commit(self, version: int, update_id: str) -> None:
        for_each(self.pool, self.targets, lambda t: t.commit(update_id, version))

    def abort(self, update_id: str) -> None:
        for target in self.targets:
            try:
                target.discard(update_id)
            except Exception:  # noqa: BLE001 -- the engine refuses the id anyway: it failed or was replaced
                pass

    def close(self) -> None:
        pass


class WeightSync:
    """Pushes buckets of ``(HF name, tensor)`` to every target through one transport."""

    def __init__(self, transport: Transport, targets: list[Any], verify: bool, pool: concurrent.futures.ThreadPoolExecutor) -> None:
        self.transport_impl = transport
        self.transport: str = transport.name
        self.targets = targets
        self.verify = verify
        self._pool = pool
        self._specs: list[Specs | None] | None = None
        self._closed = False

    def push(self, buckets: Iterable[Bucket], version: int) -> dict[str, float]:
        """Send every tensor to every engine as weight ``version``; returns the metrics (module doc).

        Raises :class:`WeightSyncError` (or the error of the ``buckets`` iterator); a failure before
        the commits leaves every engine as it was (see :class:`Transport` for the commits). A
        verification failure comes after the commits: the engines serve the update, and the error
        names the engine and the first tensor that differs."""
        if self._closed:
            raise WeightSyncError("this WeightSync is closed")
        if not isinstance(version, int) or isinstance(version, bool):
            raise WeightSyncError(f"weight version must be an integer, got {version!r}")
        specs = self.specs()
        expected = _Expected(self._algo(specs) if self.verify else None, specs)
        stats = {"bytes": 0, "tensors": 0}
        update_id = f"{version}-{uuid.uuid4().hex[:12]}"
        start = time.perf_counter()
        try:
            self.transport_impl.send(self._checked(buckets, specs, stats, expected), version, update_id)
        except BaseException as e:
            self.transport_impl.abort(update_id)
            if isinstance(e, NoriaError) and not isinstance(e, WeightSyncError):
                raise WeightSyncError(f"weight sync ({self.transport}) of version {version}: {e}") from e
            raise
        seconds = time.perf_counter() - start - expected.seconds
        metrics = {
            "sync/seconds": seconds,
            "sync/bytes": float(stats["bytes"]),
            "sync/gb_per_s": stats["bytes"] / seconds / 1e9 if seconds > 0 else 0.0,
            "sync/tensors": float(stats["tensors"]),
            **self.transport_impl.push_metrics,
        }
        if self.verify:
            t0 = time.perf_counter()
            self.check(expected, version)
            metrics["sync/verify_seconds"] = expected.seconds + time.perf_counter() - t0
        return metrics

    def verify_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> float:
        """Check every engine against ``tensors`` as version ``version`` (what ``push`` does after
        sending when ``verify`` is on); returns the seconds it took. Raises :class:`WeightSyncError`."""
        t0 = time.perf_counter()
        specs = self.specs()
        expected = _Expected(self._algo(specs), specs)
        for name, t in tensors:
            expected.add(name, t)
        self.check(expected, version)
        return time.perf_counter() - t0

    @property
    def casts_on_write(self) -> bool:
        """Whether the trainer may give tensors in any floating dtype at no cost: the transport
        casts each one to the engine's dtype as it copies it (``state_dict_for_sync(cast=False)``)."""
        return self.transport_impl.casts_on_write

    def specs(self) -> list[Specs | None]:
        """Every target's specs, asked once (None for an engine that does not say)."""
        if self._specs is None:
            self._specs = for_each(self._pool, self.targets, lambda t: t.specs())
        return self._specs

    def close(self) -> None:
        """Release the transport's resources (shared memory, groups) and the HTTP clients."""
        if self._closed:
            return
        self._closed = True
        try:
            self.transport_impl.close()
        finally:
            for t in self.targets:
                t.close()
            self._pool.shutdown(wait=False)

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------ internals

    def _checked(self, buckets: Iterable[Bucket], specs: list[Specs | None], stats: dict, expected: _Expected) -> Iterator[Bucket]:
        """Each bucket after checking every tensor against every engine's specs (before it is sent)."""
        seen: set[str] = set()
        for bucket in buckets:
            bucket = list(bucket)
            for name, t in bucket:
                if name in seen:
                    raise WeightSyncError(f"tensor '{name}' appears twice in one update")
                seen.add(name)
                for target, spec in zip(self.targets, specs):
                    if spec is not None:
                        _check_tensor(target.name, spec, name, t)
                stats["bytes"] += t.numel() * _engine_itemsize(specs, name, t)
                stats["tensors"] += 1
                expected.add(name, t)
            if bucket:
                yield bucket
        if not seen:
            raise WeightSyncError("the update holds no tensors")

    def _algo(self, specs: list[Specs | None]) -> str:
        from noria.engine.weights import CHECKSUM_ALGOS

        for target, spec in zip(self.targets, specs):
            if spec is None:
                raise WeightSyncError(f"engine {target.name} cannot report checksums (not a noria engine); set sync.verify false")
        common = [a for a in CHECKSUM_ALGOS if all(a in s.checksum_algos for s in specs if s is not None)]
        if not common:
            raise WeightSyncError(f"no checksum algorithm in common with the engines (here: {list(CHECKSUM_ALGOS)})")
        return common[0]

    def check(self, expected: _Expected, version: int) -> None:
        """Compare every engine's version and checksums with ``expected``."""

        def one(i: int) -> None:
            target = self.targets[i]
            got = target.version()
            if got != version:
                raise WeightSyncError(f"verify: engine {target.name} serves weight version {got}, not {version}")
            names = list(expected.names)
            sums = target.checksums(names, expected.algo)
            want = expected.sums_for(i)
            for name in names:
                if sums.get(name) != want[name]:
                    raise WeightSyncError(
                        f"verify: tensor '{name}' on engine {target.name} differs from the trainer's "
                        f"({expected.algo} {str(sums.get(name))[:16]} != {want[name][:16]}) after the update to version {version}"
                    )

        for_each(self._pool, list(range(len(self.targets))), one)


class _Expected:
    """The trainer's checksums of the tensors sent, per engine dtype (timed: ``seconds``)."""

    def __init__(self, algo: str | None, specs: list[Specs | None]) -> None:
        self.algo = algo
        self.specs = specs
        self.names: list[str] = []
        self._sums: dict[torch.dtype, dict[str, str]] = {}
        self.seconds = 0.0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.algo is None:
            return
        from noria.engine.weights import tensor_checksum

        t0 = time.perf_counter()
        self.names.append(name)
        for dtype in {s.tensors[name][0] for s in self.specs if s is not None and name in s.tensors}:
            self._sums.setdefault(dtype, {})[name] = tensor_checksum(tensor.detach().to(dtype), self.algo)
        self.seconds += time.perf_counter() - t0

    def sums_for(self, target_index: int) -> dict[str, str]:
        spec = self.specs[target_index]
        return {n: self._sums[spec.tensors[n][0]][n] for n in self.names}


def _engine_itemsize(specs: list[Specs | None], name: str, t: torch.Tensor) -> int:
    """Bytes per element of ``name`` as the first engine that says holds it (what crosses to it)."""
    for spec in specs:
        if spec is not None and name in spec.tensors:
            return spec.tensors[name][0].itemsize
    return t.element_size()


def _check_tensor(engine: str, spec: Specs, name: str, t: torch.Tensor) -> None:
    if name not in spec.tensors:
        raise WeightSyncError(f"engine {engine}: unknown tensor '{name}' (not a parameter of the engine's model)")
    dtype, shape = spec.tensors[name]
    if tuple(t.shape) != tuple(shape):
        raise WeightSyncError(f"engine {engine}: tensor '{name}' has shape {tuple(t.shape)}, the engine's is {tuple(shape)}")
    if t.dtype != dtype and not (t.dtype.is_floating_point and dtype.is_floating_point):
        raise WeightSyncError(f"engine {engine}: tensor '{name}' has dtype {t.dtype}, the engine's is {dtype}")


def for_each(pool: concurrent.futures.ThreadPoolExecutor, items: list[Any], fn: Callable[[Any], Any]) -> list[Any]:
    """``fn`` on every item at once (threads); all finish, then the first error is raised."""
    if len(items) == 1:
        return [fn(items[0])]
    futures = [pool.submit(fn, item) for item in items]
    concurrent.futures.wait(futures)
    for f in futures:
        if f.exception() is not None:
            raise f.exception()
    return [f.result() for f in futures]


def target_kind(target: Any) -> str:
    return "local" if isinstance(target, LocalTarget) else "http" if isinstance(target, HttpEngine) else "?"
