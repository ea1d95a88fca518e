"""The trainer's side of delta weight sync (``sync.transport: disk`` with ``sync.delta: true``).

What it owns: the **base**, i.e. the tensors of the last version this trainer published, held on
the host in the engines' dtype (one copy of the model: the memory cost of deltas), and writing
a delta folder against it (the format and the engine's side: :mod:`noria.engine.weight_delta`).

How data moves, per tensor of the push::

    trainer tensor ─cast to the engine's dtype, to host─▶ new
    new XOR base  ─all zero─▶ left out (counted as unchanged)
                  ─else─────▶ compressed frame appended to delta.bin, checksums into the manifest
    base ◀─ new (copied into the base's own buffer)

The manifest is written after every frame, so a folder without it is a partial delta. While a push
is being written the base is marked invalid (``version`` None): if the trainer's iterator or the
disk fails midway, the next push finds no base and every engine gets a full snapshot, never a
delta against a half-updated base.

Why XOR and zstd, and the measured sizes: :mod:`noria.engine.weight_delta`. Hand-written because
no library of this field diffs tensors; zstandard (or zlib) does the compression.

Blocking: :meth:`DeltaBase.write` runs on the caller's thread (cast, XOR, compress, checksum, copy).
Not guaranteed: that the engines' weights are the base (each engine checks that through the
per-tensor checksums and refuses the delta otherwise).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from noria.engine.weight_delta import (
    DATA,
    MANIFEST,
    INT_VIEW,
    DeltaEntry,
    Manifest,
    compress,
    default_codec,
    frame_checksum,
)
from noria.engine.weights import CHECKSUM_ALGOS, tensor_checksum
from noria.models.checkpoint import Bucket


@dataclass
class DeltaStats:
    """What one push changed."""

    elements: int = 0
    """Elements sent."""
    changed: int = 0
    """Elements whose bits differ from the base (all of a tensor the base lacked)."""
    unchanged_tensors: int = 0
    """Tensors sent that equal their base (left out of the delta)."""
    bytes_written: int = 0
    """Bytes of delta.bin and the manifest (0 when only the base was updated)."""


class DeltaBase:
    """The last published version's tensors and the writer of deltas against them."""

    def __init__(self, dtypes: dict[str, torch.dtype], codec: str | None = None) -> None:
        """``dtypes``: the engines' dtype of every tensor name (the delta is made in it)."""
        self.dtypes = dtypes
        self.codec = codec or default_codec()
        self.algo = CHECKSUM_ALGOS[0]
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        """The version the base holds; None before the first push or after a failed one."""

    def write(self, folder: Path | None, buckets: Iterable[Bucket], version: int) -> DeltaStats:
        """Make the base version ``version`` from ``buckets``; with ``folder`` (an empty folder),
        write there the delta from the old base. Raises whatever the buckets raise."""
        base_version, self.version = self.version, None
        stats, entries, offset = DeltaStats(), [], 0
        data = open(folder / DATA, "wb") if folder is not None else None
        try:
            for bucket in buckets:
                for name, t in bucket:
                    frame, entry = self._absorb(name, t, stats, offset, folder is not None)
                    if frame is not None and data is not None:
                        data.write(frame)
                        entries.append(entry)
                        offset += len(frame)
        finally:
            if data is not None:
                data.close()
        if folder is not None:
            base = -1 if base_version is None else base_version
            manifest = Manifest(version, base, self.codec, self.algo, offset, stats.unchanged_tensors, entries)
            text = json.dumps(manifest.as_json(), indent=1)
            (folder / MANIFEST).write_text(text)  # last: a folder without it is a partial delta
            stats.bytes_written = offset + len(text)
        self.version = version
        return stats

    def _absorb(self, name: str, t: torch.Tensor, stats: DeltaStats, offset: int, encode: bool) -> tuple[bytes | None, DeltaEntry | None]:
        """Copy ``t`` into the base; the compressed frame and manifest entry of its change, if any."""
        new = t.detach().to("cpu", self.dtypes.get(name, t.dtype)).contiguous()
        old = self.tensors.get(name)
        stats.elements += new.numel()
        if old is None or old.dtype != new.dtype or old.shape != new.shape:
            self.tensors[name] = new.clone() if new.data_ptr() == t.data_ptr() else new
            stats.changed += new.numel()
            return self._encode(name, new, "raw", new, offset) if encode else (None, None)
        view = INT_VIEW[new.element_size()]
        try:  # the XOR goes into the base's own buffer (no allocation), which then takes the new bits
            changed = int(torch.count_nonzero(old.view(view).bitwise_xor_(new.view(view))))
            stats.changed += changed
            stats.unchanged_tensors += changed == 0
            return self._encode(name, new, "xor", old, offset) if encode and changed else (None, None)
        finally:
            old.copy_(new)

    def _encode(self, name: str, new: torch.Tensor, encoding: str, payload: torch.Tensor, offset: int) -> tuple[bytes, DeltaEntry]:
        frame = compress(payload.reshape(-1).view(torch.uint8).numpy().data, self.codec)
        entry = DeltaEntry(name, new.dtype, tuple(new.shape), encoding, offset, len(frame), frame_checksum(frame, self.algo),
                           tensor_checksum(new, self.algo))  # fmt: skip
        return frame, entry
