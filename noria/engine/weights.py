"""The staging area of an engine's weights: validation, stage then commit, the shared arena, checksums.

One rule for every source: an update is **staged** first and **committed** last. Staging checks each
tensor's name, shape and dtype against the model (before any byte is copied), then copies it into a
staging buffer shaped like the parameter; the model is not touched. Commit swaps the staged buffers
into the parameters (``param.data = buffer``: no copy, O(number of tensors)) and keeps the retired
tensors as the next update's buffers. So a failed update, at any point before commit, leaves the
old weights bit for bit and the old version; and the copy of the bytes happens on the caller's
thread while the engine keeps generating, the engine pauses only for the swap.

What stages into :class:`WeightStage`: tensors in the same process (:func:`stage_tensors`; a state
dict with HF names, a subset is fine); the sources of :mod:`noria.engine.weight_sources` (a
safetensors folder, another process's shared memory or CUDA IPC buffer, a broadcast group); and the
engine's own staging buffers written by another process on the same machine: on request
(:meth:`WeightStage.share`) the parameters and their staging buffers move into a
:class:`SharedArena` (a memfd); the writer maps it, copies each tensor to the offset it was given,
and names what it wrote, which is checked (:meth:`WeightStage.mark_written`). The engine drives all
of this through its :class:`noria.engine.weight_updates.WeightUpdates` component.

Transactions: an update may arrive in several parts (buckets) under one ``update_id``; a part
with a new id drops whatever an older, uncommitted id had staged; a part that fails discards the
whole update, and that id is refused afterwards (a trainer that ignores an error cannot commit
half an update).

Checksums (:func:`tensor_checksum`): a hash (``sha256``, or ``xxh3_128`` where the xxhash package is
installed) of a tensor's dtype, shape and raw bytes, so two tensors match only if they are bitwise
equal. The trainer hashes its tensors cast to the engine's dtype and compares.

Blocking: staging holds :attr:`WeightStage.lock`; so do commit and checksums, which therefore wait
for a staging copy in progress.
Memory: the staging buffers are one extra copy of the updated tensors, kept between updates (warm
memory for the next one) until :meth:`WeightStage.release` (in a shared arena: for good). While a
colocated trainer takes its turn, :meth:`WeightStage.release_live` frees the live weights as well
(the sync that ends the turn writes all of them again): names, dtypes and shapes are kept for
staging, and only an update that stages every parameter commits.
Not guaranteed: bytes written into a shared arena are only as right as their writer made them
(names, dtypes, shapes and offsets are checked; the values only by checksums).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from noria.errors import NoriaError

if TYPE_CHECKING:
    from noria.engine.weight_sources import IpcTensor


class WeightUpdateError(NoriaError):
    """A weight update was refused or failed; the model and its version are unchanged."""


# ------------------------------------------------------------------------------------------ dtypes

ST_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
}  # fmt: skip
"""safetensors' dtype names."""
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A torch dtype from ``torch.bfloat16``, ``"bfloat16"``, ``"torch.bfloat16"`` or ``"BF16"``."""
    if isinstance(name, torch.dtype):
        return name
    if isinstance(name, str) and name in ST_DTYPES:
        return ST_DTYPES[name]
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"weight update: unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def nbytes(dtype: torch.dtype, shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


# -------------------------------------------------------------------------------------- validation


def _check_one(name: str, dtype: torch.dtype | None, shape: tuple[int, ...], spec: tuple[torch.dtype, tuple[int, ...]] | None) -> None:
    """Raise unless ``name`` is a parameter (``spec``: its dtype and shape) this tensor can update."""
    if spec is None:
        raise WeightUpdateError(f"weight update: unknown tensor '{name}' (not a model parameter)")
    want_dtype, want_shape = spec
    if tuple(shape) != tuple(want_shape):
        raise WeightUpdateError(f"weight update: tensor '{name}' has shape {tuple(shape)}, the model's is {tuple(want_shape)}")
    if dtype is not None and dtype != want_dtype and not (dtype.is_floating_point and want_dtype.is_floating_point):
        raise WeightUpdateError(
            f"weight update: tensor '{name}' has dtype {dtype_name(dtype)}, the model's is {dtype_name(want_dtype)} "
            "(only floating-point dtypes convert)"
        )


# ----------------------------------------------------------------------------------------- staging


class WeightStage:
    """Staging buffers of the update in flight, swapped into the model's parameters on commit.

    Names are the model's state-dict names; a tied head (``lm_head.weight`` of a model with tied
    embeddings) is the same parameter as the embedding, so staging either name stages both.
    """

    def __init__(self, model: nn.Module) -> None:
        self.lock = threading.RLock()
        self.update_id: str | None = None
        self._params: dict[str, nn.Parameter] = dict(model.named_parameters())
        first_name = {id(p): n for n, p in self._params.items()}
        self._canon: dict[str, str] = {}
        for name, t in model.state_dict(keep_vars=True).items():
            if id(t) not in first_name:
                raise TypeError(f"model state '{name}' is a buffer; weight updates swap parameters only")
            self._canon[name] = first_name[id(t)]
        self._staged: dict[str, torch.Tensor] = {}
        self._staged_as: dict[str, str] = {}  # canonical name -> the name it was staged under
        self._spare: dict[str, torch.Tensor] = {}
        self._refused: dict[str, None] = {}  # ids of failed updates (the newest 256), never committed
        self.arena: SharedArena | None = None
        self.released: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        """The specs of the live weights freed by :meth:`release_live` (empty while they are held)."""

    # ------------------------------------------------------------------------------ queries

    def specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """dtype and shape of every state-dict name (tied aliases included)."""
        return {n: self._spec(c) for n, c in self._canon.items()}

    def _spec(self, canon: str) -> tuple[torch.dtype, tuple[int, ...]]:
        p = self._params[canon]
        return self.released.get(canon) or (p.dtype, tuple(p.shape))

    def tensor(self, name: str) -> torch.Tensor:
        """The live parameter data of a state-dict name."""
        if name not in self._canon:
            raise WeightUpdateError(f"unknown tensor '{name}' (not a model parameter)")
        if self.released:
            raise WeightUpdateError(f"'{name}': the live weights are released until a full update is committed")
        return self._params[self._canon[name]].detach()

    # ------------------------------------------------------------------------------ staging

    @contextlib.contextmanager
    def transaction(self, update_id: str) -> Iterator[WeightStage]:
        """Stage under ``update_id``; any error discards the whole update and refuses the id."""
        with self.lock:
            self._check_not_refused(update_id)
            if update_id != self.update_id:
                self._drop_staged()
                self.update_id = update_id
            try:
                yield self
            except BaseException as e:
                self._refused[update_id] = None
                while len(self._refused) > 256:
                    del self._refused[next(iter(self._refused))]
                self._drop_staged()
                self.update_id = None
                if isinstance(e, (WeightUpdateError, KeyboardInterrupt)) or not isinstance(e, Exception):
                    raise
                raise WeightUpdateError(f"weight update {update_id!r} failed while staging: {type(e).__name__}: {e}") from e

    def _check_not_refused(self, update_id: str) -> None:
        if update_id in self._refused:
            raise WeightUpdateError(f"weight update {update_id!r} failed earlier and was discarded; start a new one")

    def check(self, name: str, dtype: torch.dtype | None, shape: Iterable[int]) -> None:
        """Validate one incoming tensor (name, dtype, shape) without copying anything."""
        canon = self._canon.get(name)
        spec = None if canon is None else self._spec(canon)
        _check_one(name, dtype, tuple(int(d) for d in shape), spec)

    def direct_buffer(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """The buffer to receive ``name`` into in place (validated by the caller), or None where the
        data must go through :meth:`put` (another dtype, or a tied alias already staged)."""
        canon = self._canon[name]
        if self._staged_as.get(canon, name) != name or self._spec(canon)[0] != dtype:
            return None
        self._staged_as[canon] = name
        return self._buffer(canon)

    def direct_span(self, items: list[tuple[str, torch.dtype, tuple[int, ...]]], offsets: list[int], size: int) -> torch.Tensor | None:
        """A uint8 view of the shared arena covering the staging buffers of ``items`` if they lie
        there exactly at ``offsets`` from the first (marked staged), else None (nothing marked)."""
        arena = self.arena
        if arena is None:
            return None
        bufs = []
        for name, dtype, _ in items:
            canon = self._canon[name]
            buf = self._staged.get(canon, self._spare.get(canon))
            if buf is None or buf.dtype != dtype or self._staged_as.get(canon, name) != name:
                return None
            bufs.append(buf)
        base = arena.offset(bufs[0])
        if any(arena.offset(b) != base + off for b, off in zip(bufs, offsets)) or base + size > arena.size:
            return None
        for name, _, _ in items:
            canon = self._canon[name]
            self._buffer(canon)
            self._staged_as[canon] = name
        return arena.data[base : base + size]

    def _buffer(self, canon: str) -> torch.Tensor:
        buf = self._staged.get(canon)
        if buf is None:
            buf = self._spare.pop(canon, None)
            if buf is None:
                dtype, shape = self._spec(canon)
                buf = torch.empty(shape, dtype=dtype, device=self._params[canon].device)
            self._staged[canon] = buf
        return buf

    @torch.no_grad()
    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Validate and copy one tensor into its staging buffer (call inside :meth:`transaction`)."""
        self.check(name, tensor.dtype, tensor.shape)
        canon = self._canon[name]
        other = self._staged_as.get(canon)
        if other is not None and other != name:  # a tied alias: fine only if both say the same
            if not torch.equal(self._staged[canon], tensor.to(self._staged[canon].dtype)):
                raise WeightUpdateError(
                    f"weight update: '{name}' and '{other}' are one tied parameter in this model, "
                    "but the update gives them different values"
                )
            return
        self._buffer(canon).copy_(tensor)
        self._staged_as[canon] = name

    def commit(self, update_id: str) -> list[str]:
        """Swap the staged buffers into the parameters; returns the parameters changed."""
        with self.lock:
            self._check_not_refused(update_id)
            if update_id != self.update_id or not self._staged:
                raise WeightUpdateError(f"weight update {update_id!r} has nothing staged to commit")
            missing = sorted(set(self.released) - set(self._staged))
            if missing:
                raise WeightUpdateError(
                    f"weight update {update_id!r} stages {len(self._staged)} of the {len(self._params)} parameters, but the "
                    f"live weights were released (a colocated trainer's turn): every one must come; missing '{missing[0]}'"
                )
            changed = list(self._staged)
            for canon, buf in self._staged.items():
                param = self._params[canon]
                old = param.data
                param.data = buf
                if canon not in self.released:
                    self._spare[canon] = old
            self._staged, self._staged_as = {}, {}
            self.released = {}
            self.update_id = None
            return changed

    def discard(self, update_id: str | None = None) -> bool:
        """Drop a staged, uncommitted update (any, if ``update_id`` is None); True if one was."""
        with self.lock:
            if self.update_id is None or (update_id is not None and update_id != self.update_id):
                return False
            self._drop_staged()
            self.update_id = None
            return True

    def release(self) -> None:
        """Free the spare buffers (the next update allocates them again); not those of a shared arena."""
        with self.lock:
            if self.arena is None:
                self._spare.clear()

    def release_live(self) -> None:
        """Free the spare buffers and the live weights, keeping their specs, until an update that
        stages every parameter commits (the caller runs this between engine steps and serves nothing
        meanwhile). Only the spare buffers in a shared arena or with an update half staged."""
        with self.lock:
            self.release()
            if self.arena is not None or self._staged:
                return
            for canon, param in self._params.items():
                self.released.setdefault(canon, self._spec(canon))
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    # ------------------------------------------------------------------------------ shared arena

    def share(self) -> SharedArena:
        """Move the parameters and their staging buffers into a :class:`SharedArena` (once; the
        caller runs this between engine steps, as it moves live parameters)."""
        with self.lock:
            if self.arena is None:
                if self._staged:
                    raise WeightUpdateError(f"update {self.update_id!r} is half staged; finish or discard it first")
                if self.released:
                    raise WeightUpdateError("the live weights are released: commit a full update before sharing them")
                arena = SharedArena({c: (p.dtype, tuple(p.shape)) for c, p in self._params.items()})
                with torch.no_grad():
                    for canon, param in self._params.items():
                        live = arena.view(0, canon)
                        live.copy_(param.data)
                        param.data = live
                        self._spare[canon] = arena.view(1, canon)
                self.arena = arena
            return self.arena

    def staging_area(self) -> dict[str, Any]:
        """Where a process on this machine writes the update in flight (inside :meth:`transaction`):
        the arena's memfd and, for every name, the byte offset of its staging buffer."""
        arena = self.arena
        if arena is None:
            raise WeightUpdateError("the engine's weights are not in shared memory")
        tensors = {}
        for name, canon in self._canon.items():
            buf = self._staged.get(canon, self._spare.get(canon))
            p = self._params[canon]
            tensors[name] = {"offset": arena.offset(buf), "dtype": dtype_name(p.dtype), "shape": list(p.shape)}
        return {"pid": os.getpid(), "fd": arena.fd, "size": arena.size, "tensors": tensors}

    def mark_written(self, manifest: list[IpcTensor]) -> int:
        """Count tensors written into the staging area by another process as staged (inside
        :meth:`transaction`): each must sit exactly at its staging buffer, in the engine's dtype."""
        arena = self.arena
        if arena is None:
            raise WeightUpdateError("the engine's weights are not in shared memory")
        for t in manifest:
            self.check(t.name, t.dtype, t.shape)
            canon = self._canon[t.name]
            buf = self._staged.get(canon, self._spare.get(canon))
            if t.dtype != buf.dtype or t.offset != arena.offset(buf):
                raise WeightUpdateError(
                    f"ipc weight update: tensor '{t.name}' was written at byte {t.offset} as {dtype_name(t.dtype)}; "
                    f"its staging buffer is at byte {arena.offset(buf)} as {dtype_name(buf.dtype)}"
                )
        for t in manifest:
            canon = self._canon[t.name]
            self._buffer(canon)
            self._staged_as.setdefault(canon, t.name)
        return len(manifest)

    def _drop_staged(self) -> None:
        self._spare.update(self._staged)
        self._staged, self._staged_as = {}, {}


class SharedArena:
    """The parameters and their staging buffers in one memfd, two regions laid out alike.

    Another process on this machine maps it through ``/proc/<pid>/fd/<fd>`` and writes an update
    straight into the staging buffers (one copy in all); the memory goes when the engine process
    and the last mapping do (a memfd, nothing left in /dev/shm after a crash). Parameters and
    staging buffers trade places at every commit, so both always live here."""

    def __init__(self, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        self.layout: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        offset = 0
        for canon, (dtype, shape) in specs.items():
            self.layout[canon] = (offset, dtype, shape)
            offset += aligned(nbytes(dtype, shape))
        self.region = max(offset, ALIGN)
        self.size = 2 * self.region
        self.fd = os.memfd_create("noria-weights", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        self._mm = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.data = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._base = self.data.data_ptr()

    def view(self, region: int, canon: str) -> torch.Tensor:
        offset, dtype, shape = self.layout[canon]
        start = region * self.region + offset
        return self.data[start : start + nbytes(dtype, shape)].view(dtype).view(shape)

    def offset(self, tensor: torch.Tensor) -> int:
        return tensor.data_ptr() - self._base


ALIGN = 64
"""Byte alignment of tensors in shared buffers (every dtype's size divides it)."""


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def stage_tensors(stage: WeightStage, named: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> int:
    """Stage in-process tensors; every name/shape/dtype is checked before the first copy."""
    items = list(named.items() if isinstance(named, dict) else named)
    if not items:
        raise WeightUpdateError("weight update holds no tensors")
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise WeightUpdateError(f"weight update: '{name}' is a {type(t).__name__}, not a tensor")
        stage.check(name, t.dtype, t.shape)
    for name, t in items:
        stage.put(name, t)
    return len(items)


# --------------------------------------------------------------------------------------- checksums


def _xxhash():
    try:
        import xxhash

        return xxhash
    except ImportError:
        return None


CHECKSUM_ALGOS: tuple[str, ...] = (("xxh3_128",) if _xxhash() is not None else ()) + ("sha256",)
"""Checksum algorithms this process can compute, fastest first."""


def tensor_checksum(tensor: torch.Tensor, algo: str = "sha256") -> str:
    """Hex digest of dtype, shape and raw bytes: equal only for bitwise-equal tensors."""
    if algo == "sha256":
        h = hashlib.sha256()
    elif algo == "xxh3_128" and _xxhash() is not None:
        h = _xxhash().xxh3_128()
    else:
        raise WeightUpdateError(f"checksum algorithm {algo!r} is not available here (have {list(CHECKSUM_ALGOS)})")
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    h.update(f"{dtype_name(t.dtype)}{list(tensor.shape)}".encode())
    if t.numel():
        h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()
