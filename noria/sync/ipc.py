"""The ``ipc`` transport: engines on the trainer's machine, reached through memory.

- An in-process ``Engine``: each bucket's tensors are handed over as they are; the engine copies
  them into its staging buffers (one copy, on this thread) and swaps them in at commit.
- An engine in another process (``noria serve`` on this machine): each bucket is packed into a
  buffer the engine can map, and its manifest (name, dtype, shape, byte offset per tensor, plus
  the buffer's handle) is posted to ``/update_weights_from_ipc``; the engine maps the buffer,
  validates the manifest against it and copies the tensors into staging. The buffer is a POSIX
  shared-memory segment (``/dev/shm``) for CPU tensors, or a CUDA buffer shared by its CUDA IPC
  handle when both the trainer's tensors and the engine are on CUDA (no host round trip).

How the cross-process data moves (two buffers, so packing and the engines' copies overlap)::

    trainer thread:  pack bucket k into buffer k%2 ─▶ post manifest k ─▶ pack bucket k+1 into buffer (k+1)%2
    engines:                                          map + copy bucket k into staging ─▶ reply

Before buffer k%2 is packed again (bucket k+2), every engine has answered for bucket k.

Ownership and clean-up: the trainer creates, owns and unlinks the segments (engines only map them
copy-on-write and never write). The two segments are kept between pushes (warm pages; each sized to
the largest bucket seen) and unlinked by ``close``, by a failed push (clean-up on error), and at
interpreter exit; a trainer killed with SIGKILL leaves them to the multiprocessing resource tracker.
Not guaranteed: CUDA IPC needs both processes on the same GPU node and is untested on CPU-only
machines; a segment cannot be seen from another machine (the engine answers with that error).
"""

from __future__ import annotations

import concurrent.futures
import os
import uuid
import weakref
from collections.abc import Iterator
from multiprocessing import shared_memory
from typing import Any

import torch

from noria.sync.targets import LocalTarget, Specs
from noria.sync.weight_sync import Bucket, Transport

ALIGN = 64
"""Byte alignment of every tensor in a buffer (any dtype's size divides it)."""


class IpcTransport(Transport):
    name = "ipc"

    def __init__(self, targets: list[Any], pool: concurrent.futures.ThreadPoolExecutor) -> None:
        super().__init__(targets, pool)
        self.local = [t for t in targets if isinstance(t, LocalTarget)]
        self.remote = [t for t in targets if not isinstance(t, LocalTarget)]
        self._buffers: list[_Buffer | None] = [None, None]
        self._remote_cuda: bool | None = None  # every remote engine on CUDA (asked once)
        self._finalizer = weakref.finalize(self, _free_all, self._buffers)

    def send(self, buckets: Iterator[Bucket], version: int, update_id: str) -> None:
        inflight: list[list[concurrent.futures.Future] | None] = [None, None]
        try:
            for k, bucket in enumerate(buckets):
                for target in self.local:
                    target.stage(bucket, update_id)
                if self.remote:
                    slot = k % 2
                    _wait(inflight[slot])  # the engines are done with this buffer
                    handle, manifest = self._pack(slot, bucket)
                    inflight[slot] = [self.pool.submit(t.stage_ipc, handle, manifest, update_id) for t in self.remote]
            for futures in inflight:
                _wait(futures)
        except BaseException:
            for futures in inflight:  # let the engines finish reading before the buffers go
                if futures:
                    concurrent.futures.wait(futures)
            self._free()
            raise
        self.commit(version, update_id)

    def close(self) -> None:
        self._free()

    def _pack(self, slot: int, bucket: Bucket) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Copy a bucket into buffer ``slot``: the handle and the manifest for the engines."""
        manifest, offset = [], 0
        for name, t in bucket:
            manifest.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": offset})
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

    def _free(self) -> None:
        _free_all(self._buffers)


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
        from noria.engine.weights import cuda_handle

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


def _free_all(buffers: list[_Buffer | None]) -> None:
    for i, buf in enumerate(buffers):
        if buf is not None:
            buffers[i] = None
            try:
                buf.free()
            except FileNotFoundError:  # already unlinked
                pass


def _wait(futures: list[concurrent.futures.Future] | None) -> None:
    if futures:
        concurrent.futures.wait(futures)
        for f in futures:
            f.result()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
