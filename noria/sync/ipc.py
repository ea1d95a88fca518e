"""The ``ipc`` transport: engines on the trainer's machine, reached through memory.

Three paths, picked per engine:

- **In process** (an ``Engine`` object): each bucket's tensors are handed over as they are; the
  engine copies them into its staging buffers (one copy) and swaps them in at commit.
- **Into the engine's staging area** (a CPU ``noria serve`` on this machine): the engine keeps its
  weights and their staging buffers in a memfd (``/weights_staging_area`` says its pid, fd and every
  tensor's offset); the trainer maps ``/proc/<pid>/fd/<fd>`` and copies each tensor straight into
  its staging buffer, casting to the engine's dtype on the way (one copy in all, as in process).
  Then it names what it wrote (``/update_weights_from_ipc`` with ``{"kind": "staging"}``; the
  engine checks every name, dtype, shape and offset) and commits.
- **Through a buffer the trainer owns** (where the engine's area cannot be mapped: a CUDA engine,
  another PID namespace): each bucket is packed into a POSIX shared-memory segment (``/dev/shm``)
  for CPU tensors, or a CUDA buffer shared by its CUDA IPC handle when the trainer's tensors and
  the engine are on CUDA; its manifest (name, dtype, shape, byte offset, and the buffer's handle)
  is posted to ``/update_weights_from_ipc``, and the engine maps it, validates the manifest against
  it and copies the tensors into staging (two copies). Two buffers alternate, so packing bucket
  k+1 overlaps the engines' copying of bucket k; a buffer is packed again only after every engine
  has answered for the bucket before.

Ownership and clean-up: the staging area belongs to the engine (a memfd: it goes with the engine
process and the trainer's mapping, nothing stays in /dev/shm); the trainer keeps its mapping
between pushes (warm pages) and drops it in ``close``. Segments belong to the trainer (engines only
map them read-only, and only while they copy a bucket) and live for one push: created at its first
bucket (each sized to the largest bucket), unlinked once every engine has answered for its last
bucket, by a failed push, by ``close`` and at interpreter exit. So a job killed as a whole between
pushes (a scheduler's SIGKILL to every process, the multiprocessing resource tracker included)
leaves nothing in /dev/shm, where a segment would hold its RAM until the machine restarts; a
trainer killed alone leaves the segments of a push in progress to the resource tracker, which
unlinks them when the trainer's end closes its pipe. (Kept between pushes, they were left behind
by every such kill: ``tests/sync/test_sync_http.py::test_segments_live_for_one_push``.) The cost:
each push maps fresh pages (a CUDA buffer, in GPU memory, is kept).

Blocking: ``send`` copies on the calling thread and waits for every engine's answer.
Not guaranteed: the trainer writes the staging area without a lock, so two pushes to one engine
at once corrupt each other's staging (never the live weights); CUDA IPC needs both processes on
one GPU node and is untested on CPU-only machines; none of this reaches another machine.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import uuid
import weakref
from collections.abc import Iterator
from multiprocessing import shared_memory
from typing import Any

import torch

from noria.sync.errors import WeightSyncError
from noria.sync.targets import LocalTarget, Specs
from noria.sync.weight_sync import Bucket, Transport, for_each

ALIGN = 64
"""Byte alignment of every tensor in a buffer (any dtype's size divides it)."""


class IpcTransport(Transport):
    name = "ipc"

    def __init__(self, targets: list[Any], pool: concurrent.futures.ThreadPoolExecutor) -> None:
        super().__init__(targets, pool)
        self.local = [t for t in targets if isinstance(t, LocalTarget)]
        self.remote = [t for t in targets if not isinstance(t, LocalTarget)]
        self._buffers: list[_Buffer | None] = [None, None]
        self._areas: dict[str, _Area] = {}  # target name -> its mapped staging area
        self._no_area: set[str] = set()  # targets whose area cannot be mapped: use segments
        self._remote_cuda: bool | None = None  # every remote engine on CUDA (asked once)
        self.use_staging_area = True
        """False: always go through the trainer's own buffers (to test or measure that path)."""
        self._finalizer = weakref.finalize(self, _free_all, self._buffers, self._areas)

    def send(self, buckets: Iterator[Bucket], version: int, update_id: str) -> None:
        direct = self._open_areas(update_id)
        via_buffer = [t for t in self.remote if t.name not in direct]
        written: dict[str, list[dict[str, Any]]] = {name: [] for name in direct}
        inflight: list[list[concurrent.futures.Future] | None] = [None, None]
        try:
            for k, bucket in enumerate(buckets):
                for target in self.local:
                    target.stage(bucket, update_id)
                for name, area in direct.items():
                    written[name] += area.write(bucket)
                if via_buffer:
                    slot = k % 2
                    _wait(inflight[slot])  # the engines are done with this buffer
                    handle, manifest = self._pack(slot, bucket)
                    inflight[slot] = [self.pool.submit(t.stage_ipc, handle, manifest, update_id) for t in via_buffer]
            for futures in inflight:
                _wait(futures)
            self._free_segments()  # every engine has copied them out: nothing of this push stays in /dev/shm
        except BaseException:
            for futures in inflight:  # let the engines finish reading before the buffers go
                if futures:
                    concurrent.futures.wait(futures)
            self._free_buffers()
            raise
        wrote = [t for t in self.remote if t.name in direct]
        if wrote:
            for_each(self.pool, wrote, lambda t: t.stage_ipc({"kind": "staging"}, written[t.name], update_id))
        self.commit(version, update_id)

    @property
    def casts_on_write(self) -> bool:
        """True once every engine's staging area is mapped (known after the first push): each tensor
        is then copied once, straight into the engine's dtype (in-process engines cast as they stage)."""
        return all(t.name in self._areas for t in self.remote)

    def close(self) -> None:
        _free_all(self._buffers, self._areas)

    # ------------------------------------------------------------------------------ staging areas

    def _open_areas(self, update_id: str) -> dict[str, _Area]:
        """The mapped staging area of every remote engine that has one this process can map."""
        out: dict[str, _Area] = {}
        if not self.use_staging_area:
            return out
        for target in self.remote:
            if target.name in self._no_area:
                continue
            info = target.staging_area(update_id)
            area = self._map(target.name, info) if info is not None else None
            if area is None:
                self._no_area.add(target.name)
            else:
                out[target.name] = area
        return out

    def _map(self, name: str, info: dict[str, Any]) -> _Area | None:
        area = self._areas.get(name)
        if area is not None and area.key == (info["pid"], info["fd"], info["size"]):
            area.tensors = info["tensors"]
            return area
        if area is not None:
            area.close()
            del self._areas[name]
        try:
            area = _Area(info)
        except OSError:  # another PID namespace or user: fall back to segments
            return None
        self._areas[name] = area
        return area

    # ------------------------------------------------------------------------------ own buffers

    def _pack(self, slot: int, bucket: Bucket) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Copy a bucket into buffer ``slot``: the handle and the manifest for the engines."""
        manifest, offset = [], 0
        for name, t in bucket:
            manifest.append({"name": name, "dtype": _dtype_name(t.dtype), "shape": list(t.shape), "offset": offset})
            offset += _aligned(t.numel() * t.element_size())
        device = bucket[0][1].device
        cuda = device.type == "cuda" and all(t.device == device for _, t in bucket) and self._engines_on_cuda()
        buf = self._buffer(slot, max(offset, 1), device if cuda else torch.device("cpu"))
        with torch.no_grad():
            for entry, (_, t) in zip(manifest, bucket):
                n = t.numel() * t.element_size()
                if n:
                    buf.data[entry["offset"] : entry["offset"] + n].view(t.dtype).view(t.shape).copy_(t)
        if cuda:
            torch.cuda.current_stream(device).synchronize()
        return buf.handle(), manifest

    def _engines_on_cuda(self) -> bool:
        if self._remote_cuda is None:
            specs: list[Specs | None] = [t.specs() for t in self.remote]
            self._remote_cuda = all(s is not None and s.device.startswith("cuda") for s in specs)
        return self._remote_cuda

    def _buffer(self, slot: int, size: int, device: torch.device) -> _Buffer:
        buf = self._buffers[slot]
        if buf is None or buf.size < size or buf.device != device:
            if buf is not None:
                buf.free()
            buf = _Buffer(size, device)
            self._buffers[slot] = buf
        return buf

    def _free_buffers(self) -> None:
        _free_all(self._buffers, {})

    def _free_segments(self) -> None:
        """Unlink the /dev/shm segments (a CUDA buffer stays: it is no file and its pages are GPU memory)."""
        for i, buf in enumerate(self._buffers):
            if buf is not None and buf.shm is not None:
                self._buffers[i] = None  # the same list: the finalizer holds it
                buf.free()


class _Area:
    """An engine's staging area mapped into this process (read-write, shared)."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.key = (info["pid"], info["fd"], info["size"])
        self.tensors: dict[str, dict[str, Any]] = info["tensors"]
        fd = os.open(f"/proc/{info['pid']}/fd/{info['fd']}", os.O_RDWR)
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, info["size"], flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.data: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)

    @torch.no_grad()
    def write(self, bucket: Bucket) -> list[dict[str, Any]]:
        """Copy each tensor into its staging buffer (cast to the engine's dtype); the manifest."""
        from noria.engine.weights import nbytes, parse_dtype

        out = []
        for name, t in bucket:
            info = self.tensors.get(name)
            if info is None:
                raise WeightSyncError(f"unknown tensor '{name}' (not in the engine's staging area)")
            dtype, shape, offset = parse_dtype(info["dtype"]), tuple(info["shape"]), int(info["offset"])
            if tuple(t.shape) != shape:
                raise WeightSyncError(f"tensor '{name}' has shape {tuple(t.shape)}, the engine's is {shape}")
            dst = self.data[offset : offset + nbytes(dtype, shape)].view(dtype).view(shape)
            dst.copy_(t)
            out.append({"name": name, "dtype": info["dtype"], "shape": list(shape), "offset": offset})
        return out

    def close(self) -> None:
        self.data = None  # the tensor must go before the mapping closes
        try:
            self._mm.close()
        except BufferError:  # a view is still alive: the mapping goes with it
            pass


class _Buffer:
    """A shared-memory segment (CPU) or a CUDA tensor (shared by its IPC handle), as a uint8 tensor."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size, self.device = size, device
        self.shm: shared_memory.SharedMemory | None = None
        if device.type == "cuda":
            self.data = torch.empty(size, dtype=torch.uint8, device=device)
            self._handle: dict[str, Any] | None = None
        else:
            name = f"noria_sync_{os.getpid()}_{uuid.uuid4().hex[:12]}"
            self.shm = shared_memory.SharedMemory(name=name, create=True, size=size)
            self.data = torch.frombuffer(self.shm.buf, dtype=torch.uint8)

    def handle(self) -> dict[str, Any]:
        if self.shm is not None:
            return {"kind": "shm", "name": self.shm.name, "size": self.size}
        from noria.engine.weight_sources import cuda_handle

        if self._handle is None:
            self._handle = cuda_handle(self.data)
        return self._handle

    def free(self) -> None:
        self.data = None  # type: ignore[assignment]  # the tensor must go before the mapping closes
        if self.shm is not None:
            shm, self.shm = self.shm, None
            try:
                shm.close()
            finally:
                shm.unlink()


def _free_all(buffers: list[_Buffer | None], areas: dict[str, _Area]) -> None:
    for i, buf in enumerate(buffers):
        if buf is not None:
            buffers[i] = None
            try:
                buf.free()
            except FileNotFoundError:  # already unlinked
                pass
    for name in list(areas):
        areas.pop(name).close()


def _wait(futures: list[concurrent.futures.Future] | None) -> None:
    if futures:
        concurrent.futures.wait(futures)
        for f in futures:
            f.result()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
