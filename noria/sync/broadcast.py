"""The ``broadcast`` transport: a torch.distributed group from the trainer (rank 0) to the engines.

The group is made at the first push: the trainer hosts the rendezvous store on 127.0.0.1 (a free
port) and every engine joins as rank 1..n (``/init_weights_update_group``, or
``engine.weights.join_group`` in process). Its backend (``sync.broadcast_backend``): gloo
when the trainer's tensors are on the CPU, NCCL when they are on CUDA (auto); gloo can be asked for
with CUDA tensors too (an engine on the trainer's own GPU, which NCCL refuses as a second rank on one
device): the trainer sends host copies and a CUDA engine receives through gloo's host staging; nccl
with CPU tensors is an error. Engine and trainer may be on different CUDA devices: each rank's NCCL
communicator lives on the device of the tensors it passes. Per bucket::

    trainer:  post the bucket's names/dtypes/shapes and chunk plan to every engine
              ─▶ one broadcast per chunk, all in flight at once: a tensor of ALONE_BYTES or more
                 is a chunk by itself, sent from its own memory; runs of smaller ones are packed
                 into a flat buffer (two alternate) of at most CHUNK_BYTES
    engines:  validate the metadata ─▶ post every receive up front, straight into the staging
              buffers (on a CPU engine they lie in parameter order in its shared arena, so a packed
              chunk lands in place too; otherwise it is received into scratch and copied out)
              ─▶ reply

then every engine commits the update. An engine that refuses a bucket still receives its chunks
(into scratch), so the trainer never blocks on a refusal; it then answers with the error. Chunks
are a Noria extension (``chunks`` on ``/update_weights_from_distributed``); SGLang's protocol (one
broadcast per tensor) is what the engine does without them.

Blocking: the broadcasts run on a helper thread while the trainer waits for the engines' replies;
if an engine fails without receiving (it died, or lost the group), the push raises at once and the
group is abandoned (the helper thread waits out :data:`GROUP_TIMEOUT_S` in the background); the
next push makes a new group. Not guaranteed: engines on another machine (the store listens on
127.0.0.1 only; use the disk transport there).
"""

from __future__ import annotations

import concurrent.futures
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import torch

from noria.sync.errors import WeightSyncError
from noria.sync.weight_sync import Bucket, Transport, for_each

CHUNK_BYTES = 32 << 20
"""Consecutive small tensors are packed and sent together, as one flat broadcast of at most this many bytes."""
ALONE_BYTES = 1 << 20
"""A tensor this large is sent by itself, from its own memory: a broadcast call costs less than packing it."""
GROUP_TIMEOUT_S = 300.0
"""How long a rendezvous or a broadcast may wait for the other ranks."""
MASTER_ADDRESS = "127.0.0.1"


class BroadcastTransport(Transport):
    name = "broadcast"

    def __init__(self, targets: list[Any], pool: concurrent.futures.ThreadPoolExecutor, backend: str = "auto") -> None:
        """``backend``: auto (by the device of the tensors sent), nccl or gloo."""
        super().__init__(targets, pool)
        if backend not in ("auto", "nccl", "gloo"):
            raise WeightSyncError(f"broadcast backend must be auto, nccl or gloo, got {backend!r}")
        self.wanted = backend
        self.group: Any = None
        self.group_name = ""
        self.backend = ""
        self._flat: list[torch.Tensor | None] = [None, None]  # packing buffers, kept between pushes

    def send(self, buckets: Iterator[Bucket], version: int, update_id: str) -> None:
        for bucket in buckets:
            self._ensure_group(self._backend_for(bucket[0][1].device))
            tensors = [self._sendable(t) for _, t in bucket]
            chunks = _chunks(tensors, CHUNK_BYTES)
            names = [n for n, _ in bucket]
            dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors]
            shapes = [list(t.shape) for t in tensors]
            sizes = [len(c) for c in chunks]
            replies = [self.pool.submit(t.stage_broadcast, names, dtypes, shapes, self.group_name, update_id, sizes) for t in self.targets]
            self._broadcast(lambda group: self._send_chunks(group, chunks), replies)
        self.commit(version, update_id)

    def close(self) -> None:
        self._drop_group()
        self._flat = [None, None]

    def _backend_for(self, device: torch.device) -> str:
        if self.wanted == "nccl" and device.type != "cuda":
            raise WeightSyncError(f"sync.broadcast_backend nccl needs the trainer's weights on CUDA, they are on {device}")
        if self.wanted != "auto":
            return self.wanted
        return "nccl" if device.type == "cuda" else "gloo"

    def _sendable(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if self.backend == "gloo" and t.device.type != "cpu":
            t = t.cpu()
        return t.contiguous()

    def _send_chunks(self, group: Any, chunks: list[list[torch.Tensor]]) -> None:
        """One broadcast per chunk, all in flight at once (the engines post every receive up front).
        A lone tensor goes from its own memory; several are packed into a flat buffer, two of which
        alternate (packing a chunk waits only for the send of the chunk before last)."""
        from noria.engine.weight_sources import flat_offsets

        works, packed_in, packs = [], [None, None], 0  # packed_in: the send that last used each buffer
        for chunk in chunks:
            if len(chunk) == 1:
                works.append(group.broadcast(chunk[0].reshape(-1).view(torch.uint8), 0))
                continue
            slot, packs = packs % 2, packs + 1
            if packed_in[slot] is not None:
                packed_in[slot].wait()
            offsets, size = flat_offsets([t.dtype for t in chunk], [tuple(t.shape) for t in chunk])
            buf = self._flat_buffer(slot, size, chunk[0].device)[:size]
            with torch.no_grad():
                for t, off in zip(chunk, offsets):
                    buf[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
            packed_in[slot] = group.broadcast(buf, 0)
            works.append(packed_in[slot])
        for work in works:
            work.wait()

    def _flat_buffer(self, slot: int, size: int, device: torch.device) -> torch.Tensor:
        buf = self._flat[slot]
        if buf is None or buf.numel() < size or buf.device != device:
            buf = torch.empty(max(size, CHUNK_BYTES), dtype=torch.uint8, device=device)
            self._flat[slot] = buf
        return buf

    def _broadcast(self, send: Any, replies: list[concurrent.futures.Future]) -> None:
        """Run ``send(group)`` on a helper thread; raise as soon as an engine fails, else when all
        are done."""
        sent: concurrent.futures.Future = concurrent.futures.Future()
        group = self.group

        def run() -> None:
            try:
                send(group)
                sent.set_result(None)
            except BaseException as e:  # noqa: BLE001 -- handed to the waiting thread
                sent.set_exception(e)

        threading.Thread(target=run, name="noria-sync-broadcast", daemon=True).start()
        pending = {sent, *replies}
        while pending:
            done, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            for f in done:
                if f.exception() is not None:
                    if not sent.done():  # the broadcast is stuck on a rank that left: give the group up
                        self._drop_group()
                    elif pending:
                        concurrent.futures.wait(pending)
                    if f is sent:
                        raise WeightSyncError(f"broadcast over group {self.group_name!r} failed: {f.exception()}")
                    raise f.exception()

    def _ensure_group(self, backend: str) -> None:
        if self.group is not None and self.backend == backend:
            return
        self._drop_group()
        from noria.engine.weight_sources import create_update_group
        from noria.net import free_port

        port = free_port(MASTER_ADDRESS)
        name = f"noria-sync-{uuid.uuid4().hex[:8]}"
        world = len(self.targets) + 1
        made: concurrent.futures.Future = concurrent.futures.Future()

        def host() -> None:
            try:
                made.set_result(create_update_group(MASTER_ADDRESS, port, 0, world, name, backend, GROUP_TIMEOUT_S))
            except BaseException as e:  # noqa: BLE001 -- handed to the waiting thread
                made.set_exception(e)

        threading.Thread(target=host, name="noria-sync-rendezvous", daemon=True).start()
        for_each(self.pool, list(enumerate(self.targets)), lambda it: it[1].join_group(MASTER_ADDRESS, port, it[0] + 1, world, name, backend))
        try:
            self.group = made.result(timeout=GROUP_TIMEOUT_S)
        except Exception as e:
            raise WeightSyncError(f"weight sync group {name!r} ({backend}, {world} ranks) did not form: {e}") from e
        self.group_name, self.backend = name, backend

    def _drop_group(self) -> None:
        if self.group is None:
            return
        for t in self.targets:
            try:
                t.leave_group(self.group_name)
            except Exception:  # noqa: BLE001 -- best effort: the engine may be gone
                pass
        self.group = None


def _chunks(tensors: list[torch.Tensor], limit: int, alone: int = ALONE_BYTES) -> list[list[torch.Tensor]]:
    """Consecutive tensors in chunks: one of ``alone`` bytes or more goes by itself (sent from its
    own memory), smaller ones together up to ``limit`` bytes (packed into one buffer)."""
    out: list[list[torch.Tensor]] = []
    size = limit
    for t in tensors:
        n = t.numel() * t.element_size()
        if n >= alone or size + n > limit:
            out.append([t])
            size = limit if n >= alone else n
        else:
            out[-1].append(t)
            size += n
    return out
