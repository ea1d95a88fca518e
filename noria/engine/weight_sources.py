"""Where a weight update comes from: a safetensors folder, another process's memory, a broadcast group.

Each source validates what it is given against the model (through :meth:`WeightStage.check`, before
any byte is copied) and then copies into the staging buffers of :class:`noria.engine.weights.WeightStage`:

- a safetensors folder: every file header is parsed and checked (names, shapes, dtypes, data
  offsets inside the file) before any tensor is read; then each tensor is read through a shared
  read-only mmap straight into its buffer (:func:`folder_entries`, :func:`stage_from_folder`);
- an IPC buffer from another process on the same machine: a POSIX shared-memory segment
  (``/dev/shm/<name>``, mapped read-only) or a CUDA IPC handle, plus a manifest of (name, dtype,
  shape, byte offset) validated against the buffer size (:func:`open_ipc`, :func:`stage_from_ipc`);
- a torch.distributed broadcast from rank 0 of a group made by :func:`create_update_group` (the
  trainer calls it with ``rank=0``; it hosts the store). The group is standalone (its own store and
  backend object), so it never touches a default process group the host process may have. Tensors
  are received straight into their staging buffers; when the metadata is refused, the tensors are
  still received (into scratch) so that rank 0 is never left blocked in a broadcast
  (:func:`stage_from_broadcast`).

Hand-written because safetensors' own reader opens a private mapping and hands out tensors it
owns: here headers are checked as a whole before any read, and bytes land in buffers the engine
already holds. torch.distributed provides the groups; only the standalone rendezvous (a store bound
to one address) is assembled here.

Blocking: group creation blocks until all ``world_size`` ranks have joined; a broadcast receive
until rank 0 has sent every tensor. Not guaranteed: a broadcast whose metadata cannot even be parsed
cannot be drained (rank 0 then waits for its group timeout); a shared-memory or CUDA IPC source must
stay unchanged until the call returns (the sender's job).
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import ipaddress
import json
import mmap
import os
import re
import socket
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from noria.engine.weights import (
    ST_DTYPES,
    WeightStage,
    WeightUpdateError,
    aligned,
    dtype_name,
    nbytes,
    parse_dtype,
)
from noria.models.checkpoint import tensor_files
from noria.models.moe import disk_layout, stacked_name

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
    """Validate every header entry of ``folder``, then read each tensor into its staging buffer.
    MoE experts stored one tensor per expert (HF's layout) go into the model's stacked tensors:
    every piece of a stacked tensor or none (:func:`_check_pieces`); they are copied straight into
    its staging buffer, or, in another dtype, assembled first (one extra copy of those tensors)."""
    entries = folder_entries(folder)
    specs = stage.specs()
    groups: dict[str, list[FileTensor]] = {}
    for e in entries:
        target = stacked_name(e.name)
        if target is not None and e.name not in specs and target in specs:
            groups.setdefault(target, []).append(e)
        else:
            stage.check(e.name, e.dtype, e.shape)
    views: dict[str, torch.Tensor] = {}
    assembled: dict[str, torch.Tensor] = {}
    for name, pieces in groups.items():
        _check_pieces(name, specs[name][1], pieces)
        dest = stage.direct_buffer(name, pieces[0].dtype)
        if dest is None:
            dest = assembled[name] = torch.empty(specs[name][1], dtype=pieces[0].dtype)
        views.update(disk_layout({name: dest}))
    by_file: dict[Path, list[FileTensor]] = {}
    for e in entries:
        by_file.setdefault(e.file, []).append(e)
    for file, items in by_file.items():
        with _mapped(file) as mm:
            data = _bytes_tensor(mm)
            for e in items:
                tensor = _typed_view(data, e.start, e.end, e.dtype, e.shape)
                if e.name in views:
                    views[e.name].copy_(tensor)
                else:
                    stage.put(e.name, tensor)
            del data
    for name, full in assembled.items():
        stage.put(name, full)
    return len(entries)


def _check_pieces(name: str, shape: tuple[int, ...], pieces: list[FileTensor]) -> None:
    """The per-expert tensors of stacked ``name`` fit it, in one dtype, and none is missing."""
    views = disk_layout({name: torch.empty(shape, device="meta")})
    for e in pieces:
        view = views.get(e.name)
        if view is None or tuple(view.shape) != e.shape or e.dtype != pieces[0].dtype:
            raise WeightUpdateError(
                f"weight update from disk: expert tensor '{e.name}' ({dtype_name(e.dtype)} {list(e.shape)}) "
                f"does not fit '{name}' ({list(shape)})"
            )
    missing = sorted(set(views) - {e.name for e in pieces})
    if missing:
        raise WeightUpdateError(
            f"weight update from disk: '{missing[0]}' is missing; the experts of '{name}' are updated all together"
        )


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
    if backend == "nccl" and not dist.is_nccl_available():
        raise WeightUpdateError("weight update group: backend nccl is not available in this build of torch (a CPU engine uses gloo)")
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
        start = aligned(end)
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
