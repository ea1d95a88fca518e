"""Weight updates of a running engine: validation, staging, the sources, and checksums.

One rule for every source: an update is **staged** first and **committed** last. Staging checks each
tensor's name, shape and dtype against the model (before any byte is copied), then copies it into a
staging buffer shaped like the parameter; the model is not touched. Commit swaps the staged buffers
into the parameters (``param.data = buffer``: no copy, O(number of tensors)) and keeps the retired
tensors as the next update's buffers. So a failed update, at any point before commit, leaves the
old weights bit for bit and the old version; and the copy of the bytes happens on the caller's
thread while the engine keeps generating, the engine pauses only for the swap.

Sources (all stage into :class:`WeightStage`):

- tensors in the same process (a state dict, HF names, a subset is fine);
- a safetensors folder: every file header is parsed and checked (names, shapes, dtypes, data
  offsets inside the file) before any tensor is read; then each tensor is read through a private
  mmap straight into its buffer (:func:`folder_entries`, :func:`stage_from_folder`);
- an IPC buffer from another process on the same machine: a POSIX shared-memory segment
  (``/dev/shm/<name>``, mapped read-only) or a CUDA IPC handle, plus a manifest
  of (name, dtype, shape, byte offset) validated against the buffer size (:func:`open_ipc`);
- the engine's own staging buffers, written by another process on the same machine: on request
  (:meth:`WeightStage.share`) the parameters and their staging buffers move into a
  :class:`SharedArena` (a memfd); the writer maps it, copies each tensor to the offset it was
  given, and names what it wrote, which is checked (:meth:`WeightStage.mark_written`);
- a torch.distributed broadcast from rank 0 of a group made by :func:`create_update_group` (the
  trainer calls it with ``rank=0``; it hosts the store). The group is standalone (its own store and
  backend object), so it never touches a default process group the host process may have. Tensors
  are received straight into their staging buffers; when the metadata is refused, the tensors are
  still received (into scratch) so that rank 0 is never left blocked in a broadcast.

Transactions: an update may arrive in several parts (buckets) under one ``update_id``; a part
with a new id drops whatever an older, uncommitted id had staged; a part that fails discards the
whole update, and that id is refused afterwards (a trainer that ignores an error cannot commit
half an update).

Checksums (:func:`tensor_checksum`): a hash (``sha256``, or ``xxh3_128`` where the xxhash package is
installed) of a tensor's dtype, shape and raw bytes, so two tensors match only if they are bitwise
equal. The trainer hashes its tensors cast to the engine's dtype and compares.

Blocking: group creation blocks until all ``world_size`` ranks have joined; a broadcast receive
until rank 0 has sent every tensor. Staging holds :attr:`WeightStage.lock`; so do commit and
checksums, which therefore wait for a staging copy in progress.
Memory: the staging buffers are one extra copy of the updated tensors, kept between updates (warm
memory for the next one) until :meth:`WeightStage.release` (in a shared arena: for good).
Not guaranteed: a broadcast whose metadata cannot even be parsed cannot be drained (rank 0 then
waits for its group timeout); a shared-memory or CUDA IPC source must stay unchanged until the
call returns (the sender's job); bytes written into a shared arena are only as right as their
writer made them (names, dtypes, shapes and offsets are checked; the values only by checksums).
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import hashlib
import ipaddress
import json
import mmap
import os
import re
import socket
import threading
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from noria.errors import NoriaError
from noria.models.checkpoint import tensor_files


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

    # ------------------------------------------------------------------------------ queries

    def specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """dtype and shape of every state-dict name (tied aliases included)."""
        return {n: (self._params[c].dtype, tuple(self._params[c].shape)) for n, c in self._canon.items()}

    def tensor(self, name: str) -> torch.Tensor:
        """The live parameter data of a state-dict name."""
        if name not in self._canon:
            raise WeightUpdateError(f"unknown tensor '{name}' (not a model parameter)")
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
        spec = None if canon is None else (self._params[canon].dtype, tuple(self._params[canon].shape))
        _check_one(name, dtype, tuple(int(d) for d in shape), spec)

    def direct_buffer(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """The buffer to receive ``name`` into in place (validated by the caller), or None where the
        data must go through :meth:`put` (another dtype, or a tied alias already staged)."""
        canon = self._canon[name]
        if self._staged_as.get(canon, name) != name or self._params[canon].dtype != dtype:
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
                p = self._params[canon]
                buf = torch.empty(p.shape, dtype=p.dtype, device=p.device)
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
            changed = list(self._staged)
            for canon, buf in self._staged.items():
                param = self._params[canon]
                old = param.data
                param.data = buf
                self._spare[canon] = old
            self._staged, self._staged_as = {}, {}
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

    # ------------------------------------------------------------------------------ shared arena

    def share(self) -> SharedArena:
        """Move the parameters and their staging buffers into a :class:`SharedArena` (once; the
        caller runs this between engine steps, as it moves live parameters)."""
        with self.lock:
            if self.arena is None:
                if self._staged:
                    raise WeightUpdateError(f"update {self.update_id!r} is half staged; finish or discard it first")
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
            offset += _aligned(nbytes(dtype, shape))
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


def _aligned(n: int) -> int:
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


# -------------------------------------------------------------------------------------------- disk


@dataclass(frozen=True)
class FileTensor:
    """One tensor of a safetensors file, located from the header alone."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path
    start: int
    """Absolute byte offset of the data in the file."""
    end: int


def read_header(file: Path) -> list[FileTensor]:
    """Parse and check a safetensors header: dtypes known, offsets inside the file and consistent."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightUpdateError(f"{file}: not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(head, "little")
        if n <= 0 or 8 + n > size:
            raise WeightUpdateError(f"{file}: header length {n} does not fit in the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WeightUpdateError(f"{file}: the safetensors header is not valid JSON: {e}") from e
    base, out = 8 + n, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = ST_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise WeightUpdateError(f"{file}: bad header entry for tensor '{name}': {info!r}") from e
        if not 0 <= start <= end or base + end > size or end - start != nbytes(dtype, shape):
            raise WeightUpdateError(
                f"{file}: tensor '{name}' ({dtype_name(dtype)} {list(shape)}) has data offsets [{start}, {end}] "
                f"that do not fit its size or the file ({size} bytes): truncated or corrupt"
            )
        out.append(FileTensor(name, dtype, shape, file, base + start, base + end))
    return out


def folder_entries(folder: str | Path) -> list[FileTensor]:
    """Every tensor of a safetensors folder (single file or sharded index), headers checked."""
    try:
        files = tensor_files(folder)
    except (FileNotFoundError, KeyError, json.JSONDecodeError) as e:
        raise WeightUpdateError(f"weight update from disk: {e}") from e
    entries = []
    for f in sorted(set(files.values())):
        try:
            entries += [e for e in read_header(f) if files.get(e.name) == f]
        except OSError as e:
            raise WeightUpdateError(f"weight update from disk: cannot read {f}: {e}") from e
    missing = sorted(set(files) - {e.name for e in entries})
    if missing:
        raise WeightUpdateError(f"weight update from disk: the index of {folder} lists '{missing[0]}', which its file lacks")
    if not entries:
        raise WeightUpdateError(f"weight update from disk: {folder} holds no tensors")
    return entries


def stage_from_folder(stage: WeightStage, folder: str | Path) -> int:
    """Validate every header entry of ``folder``, then read each tensor into its staging buffer."""
    entries = folder_entries(folder)
    for e in entries:
        stage.check(e.name, e.dtype, e.shape)
    by_file: dict[Path, list[FileTensor]] = {}
    for e in entries:
        by_file.setdefault(e.file, []).append(e)
    for file, items in by_file.items():
        with _mapped(file) as mm:
            data = _bytes_tensor(mm)
            for e in items:
                stage.put(e.name, _typed_view(data, e.start, e.end, e.dtype, e.shape))
            del data
    return len(entries)


def _map_read_only(fd: int, size: int) -> mmap.mmap:
    """A read-only shared mapping, pages populated up front. (Not a private writable one: populating
    that would copy every page to break copy-on-write.)"""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)


def _bytes_tensor(mm: mmap.mmap) -> torch.Tensor:
    """A uint8 tensor over a read-only mapping; only ever read (copied from) here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mm, dtype=torch.uint8)


@contextlib.contextmanager
def _mapped(file: Path) -> Iterator[mmap.mmap]:
    """A read-only mapping of a whole file, pages populated up front."""
    fd = os.open(file, os.O_RDONLY)
    try:
        mm = _map_read_only(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    try:
        yield mm
    finally:
        _close(mm)


def _close(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a tensor view is still alive somewhere: the mapping goes when it does
        pass


def _typed_view(data: torch.Tensor, start: int, end: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``data[start:end]`` (uint8) seen as ``dtype`` and ``shape``; copied when misaligned for the dtype."""
    raw = data[start:end]
    if start % _itemsize(dtype):
        raw = raw.clone()
    return raw.view(dtype).view(shape)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------------------------- ipc

SHM_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")
SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class IpcTensor:
    """One tensor inside an IPC buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the buffer (a multiple of the dtype's size)."""


def parse_manifest(tensors: Any, size: int) -> list[IpcTensor]:
    """``[{name, dtype, shape, offset}, ...]`` checked against a buffer of ``size`` bytes."""
    if not isinstance(tensors, list) or not tensors:
        raise WeightUpdateError("ipc weight update: 'tensors' must be a non-empty list of {name, dtype, shape, offset}")
    out = []
    for i, t in enumerate(tensors):
        try:
            name, dtype = str(t["name"]), parse_dtype(t["dtype"])
            shape, offset = tuple(int(d) for d in t["shape"]), int(t["offset"])
        except (KeyError, TypeError, ValueError) as e:
            raise WeightUpdateError(f"ipc weight update: tensors[{i}] is malformed: {t!r}") from e
        end = offset + nbytes(dtype, shape)
        if offset < 0 or end > size or offset % _itemsize(dtype) or any(d < 0 for d in shape):
            raise WeightUpdateError(
                f"ipc weight update: tensor '{name}' at byte {offset} ({dtype_name(dtype)} {list(shape)}) does not fit "
                f"a buffer of {size} bytes aligned to its dtype"
            )
        out.append(IpcTensor(name, dtype, shape, offset))
    return out


@contextlib.contextmanager
def open_ipc(handle: dict[str, Any], device: torch.device) -> Iterator[torch.Tensor]:
    """A uint8 tensor over the sender's buffer: ``{"kind": "shm", "name", "size"}`` or
    ``{"kind": "cuda", ...}`` (the fields of ``UntypedStorage._share_cuda_``, bytes in base64)."""
    if not isinstance(handle, dict):
        raise WeightUpdateError("ipc weight update: 'handle' must be an object")
    kind = handle.get("kind")
    if kind == "staging":
        raise WeightUpdateError("ipc weight update: a 'staging' handle has no buffer to open")
    if kind == "shm":
        with _open_shm(handle) as buf:
            yield buf
    elif kind == "cuda":
        yield _open_cuda(handle, device)
    else:
        raise WeightUpdateError(f"ipc weight update: handle kind must be 'shm' or 'cuda', got {kind!r}")


@contextlib.contextmanager
def _open_shm(handle: dict[str, Any]) -> Iterator[torch.Tensor]:
    name, size = handle.get("name"), handle.get("size")
    if not isinstance(name, str) or not SHM_NAME.match(name):
        raise WeightUpdateError(f"ipc weight update: bad shared-memory segment name {name!r}")
    if not isinstance(size, int) or size <= 0:
        raise WeightUpdateError(f"ipc weight update: segment size must be a positive integer, got {size!r}")
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as e:
        raise WeightUpdateError(
            f"ipc weight update: shared-memory segment {name!r} not found (is the engine on another machine?)"
        ) from e
    try:
        actual = os.fstat(fd).st_size
        if actual < size:
            raise WeightUpdateError(f"ipc weight update: segment {name!r} holds {actual} bytes, the update says {size}")
        mm = _map_read_only(fd, size)
    finally:
        os.close(fd)
    try:
        yield _bytes_tensor(mm)
    finally:
        _close(mm)


def _open_cuda(handle: dict[str, Any], device: torch.device) -> torch.Tensor:
    if not torch.cuda.is_available():
        raise WeightUpdateError("ipc weight update: a CUDA IPC handle needs CUDA in the engine process")
    try:
        fields = (
            int(handle["device"]), base64.b64decode(handle["handle"]), int(handle["size"]), int(handle["offset"]),
            base64.b64decode(handle["ref_counter_handle"]), int(handle["ref_counter_offset"]),
            base64.b64decode(handle["event_handle"]) if handle.get("event_handle") else b"",
            bool(handle["event_sync_required"]),
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as e:
        raise WeightUpdateError(f"ipc weight update: malformed CUDA IPC handle: {e}") from e
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(*fields)
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{fields[0]}").set_(storage)


def cuda_handle(buffer: torch.Tensor) -> dict[str, Any]:
    """The JSON form of a CUDA tensor's IPC handle (the sender side of :func:`open_ipc`)."""
    device, handle, size, offset, ref_handle, ref_offset, event, sync = buffer.untyped_storage()._share_cuda_()
    return {
        "kind": "cuda", "device": int(device), "handle": base64.b64encode(handle).decode(), "size": int(size),
        "offset": int(offset), "ref_counter_handle": base64.b64encode(ref_handle).decode(),
        "ref_counter_offset": int(ref_offset), "event_handle": base64.b64encode(event or b"").decode(),
        "event_sync_required": bool(sync),
    }  # fmt: skip


def stage_from_ipc(stage: WeightStage, buffer: torch.Tensor, manifest: list[IpcTensor]) -> int:
    """Validate every manifest entry, then copy each tensor out of ``buffer`` into staging."""
    for t in manifest:
        stage.check(t.name, t.dtype, t.shape)
    for t in manifest:
        stage.put(t.name, _typed_view(buffer, t.offset, t.offset + nbytes(t.dtype, t.shape), t.dtype, t.shape))
    return len(manifest)


# --------------------------------------------------------------------------------------- broadcast


JOIN_TIMEOUT_S = 30.0
"""How long an engine joining a weight-update group waits for the rendezvous (an unreachable master
fails the join within this, instead of holding the request for the group's whole timeout)."""


def create_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    join_timeout_s: float | None = None,
):
    """A standalone process group; rank 0 hosts the TCP store. Blocks until all ranks join (at most
    ``join_timeout_s``, default ``timeout_s``); each collective then waits at most ``timeout_s``.

    Rank 0's store listens on ``master_address`` only (a socket bound there first and handed to the
    store; ``TCPStore`` alone listens on every interface), and with a loopback master every rank's
    gloo sockets are bound to that loopback address too: nothing of the group is reachable from
    another machine unless the caller names a non-loopback master."""
    if backend not in ("gloo", "nccl"):
        raise WeightUpdateError(f"weight update group: backend must be gloo or nccl, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    join = datetime.timedelta(seconds=join_timeout_s or timeout_s)
    try:
        store = dist.PrefixStore(group_name, _rendezvous_store(master_address, master_port, rank, world_size, join))
    except (RuntimeError, OSError) as e:  # classify: the rendezvous failed or timed out
        raise WeightUpdateError(f"weight update group {group_name!r}: rendezvous at {master_address}:{master_port} failed: {e}") from e
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, _gloo_options(master_address, timeout))
    return dist.ProcessGroupNCCL(store, rank, world_size)


def _rendezvous_store(address: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta):
    """Rank 0: a TCP store listening on ``address`` alone; other ranks: a client of it."""
    if rank != 0:
        return dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.create_server((address, port), family=family, backlog=max(world_size, 16))
    fd = listener.detach()  # the store owns the listening socket from here on
    return dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout, master_listen_fd=fd)


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name
        return address == "localhost"


def _gloo_options(master_address: str, timeout: datetime.timedelta):
    """Gloo bound to the loopback address when the master is local (else the default interface)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    if _is_loopback(master_address):
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=master_address)]
    else:
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return opts


def stage_from_broadcast(
    stage: WeightStage, group, names: list[str], dtypes: list, shapes: list, device: torch.device,
    chunks: list[int] | None = None,
) -> int:
    """Receive a bucket broadcast by rank 0 into staging, in ``names`` order.

    Without ``chunks`` (SGLang's protocol) every tensor is one broadcast, received straight into
    its staging buffer. With ``chunks`` (counts of consecutive tensors) every chunk is one broadcast
    of a flat byte buffer holding its tensors at :func:`flat_offsets`; it is received straight into
    the staging buffers where they lie exactly so in memory (a shared arena holds them in parameter
    order), else into scratch memory and copied out.

    The metadata is validated first; if it is refused, everything is still received into scratch
    memory (rank 0 is sending it regardless) and the error is raised afterwards."""
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightUpdateError("names, dtypes and shapes must have the same length")
    parsed = [parse_dtype(d) for d in dtypes]  # unparseable: nothing can be drained
    dims = [tuple(int(d) for d in s) for s in shapes]
    groups = _chunk_ranges(len(names), chunks)
    error: WeightUpdateError | None = None
    try:
        if not names:
            raise WeightUpdateError("weight update holds no tensors")
        for name, dtype, shape in zip(names, parsed, dims):
            stage.check(name, dtype, shape)
    except WeightUpdateError as e:
        error = e
    plans = []
    for start, end in groups:  # where every broadcast lands, before the first one is received
        items = list(zip(names[start:end], parsed[start:end], dims[start:end]))
        plans.append(_plan_chunk(stage, items, device, refused=error is not None, flat=chunks is not None))
    works = [group.broadcast(target, 0) for target, _ in plans]  # all posted: rank 0 streams them
    for work, (target, scatter) in zip(works, plans):
        work.wait()
        if scatter and error is None:
            try:
                for name, view in scatter(target):
                    stage.put(name, view)
            except WeightUpdateError as e:  # keep receiving: rank 0 sends the rest regardless
                error = e
    if error is not None:
        raise error
    return len(names)


def flat_offsets(dtypes: list[torch.dtype], shapes: list[tuple[int, ...]]) -> tuple[list[int], int]:
    """Byte offsets of tensors laid one after another, each starting aligned to :data:`ALIGN`,
    and the size (up to the end of the last one: a lone tensor is exactly its own bytes)."""
    offsets, end = [], 0
    for dtype, shape in zip(dtypes, shapes):
        start = _aligned(end)
        offsets.append(start)
        end = start + nbytes(dtype, shape)
    return offsets, end


def _chunk_ranges(n: int, chunks: list[int] | None) -> list[tuple[int, int]]:
    if chunks is None:
        return [(i, i + 1) for i in range(n)]
    if not isinstance(chunks, list) or not all(isinstance(c, int) and c > 0 for c in chunks) or sum(chunks) != n:
        raise WeightUpdateError(f"chunks must be positive tensor counts adding up to {n}, got {chunks!r}")
    out, start = [], 0
    for c in chunks:
        out.append((start, start + c))
        start += c
    return out


def _plan_chunk(stage: WeightStage, items: list[tuple[str, torch.dtype, tuple[int, ...]]], device: torch.device, refused: bool, flat: bool):
    """(the tensor one broadcast is received into, None or a function giving (name, view) pairs to
    copy into staging from it). In place where the staging buffers allow, else scratch memory."""
    if not flat:
        name, dtype, shape = items[0]
        buf = None if refused else stage.direct_buffer(name, dtype)
        if buf is not None:
            return buf, None
        return torch.empty(shape, dtype=dtype, device=device), lambda t: [(name, t)]
    offsets, size = flat_offsets([d for _, d, _ in items], [s for _, _, s in items])
    target = None if refused else stage.direct_span(items, offsets, size)
    if target is not None:
        return target, None

    def scatter(buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [(n, _typed_view(buf, o, o + nbytes(d, s), d, s)) for (n, d, s), o in zip(items, offsets)]

    return torch.empty(size, dtype=torch.uint8, device=device), scatter


def send_broadcast(group, tensors: dict[str, torch.Tensor] | Iterable[torch.Tensor]) -> None:
    """The rank-0 side of a broadcast update (trainers and tests call this)."""
    for tensor in tensors.values() if isinstance(tensors, dict) else tensors:
        group.broadcast(tensor.detach().contiguous(), 0).wait()


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
