"""The weight-delta folder: what changed since the previous version, and how an engine applies it.

A delta folder ``DIR/d00000013/`` (written by ``noria.sync.delta``, published by one rename) holds:

- ``delta.bin``: one compressed frame per changed tensor, back to back;
- ``delta.json``, the manifest: ``format`` (``noria-delta``), ``format_version`` (1), ``version``
  (the version it makes), ``base_version`` (the only version it applies to), ``codec`` (``zstd``
  or ``zlib``), ``checksum_algo``, ``data_bytes`` (the size of ``delta.bin``), ``unchanged`` (how
  many tensors of the push equal their base and are left out), and per changed tensor: ``name``
  (the model's state-dict name; MoE experts stacked as the model holds them), ``dtype``
  (safetensors' name), ``shape``, ``encoding``, ``offset`` and ``length`` of its frame in
  ``delta.bin``, ``data_checksum`` (of the frame's bytes) and ``checksum`` (of the tensor it makes,
  :func:`noria.engine.weights.tensor_checksum`).

Encodings: ``xor``: the frame decompresses to ``new XOR base``, the tensors' bit patterns seen as
integers of their element size (bf16 as int16, fp32 as int32), so the result is bitwise exact and
an unchanged element is a zero; ``raw``: the frame decompresses to the new bytes (a tensor the base
lacks). XOR rather than a sparse list of (index, value): at RL learning rates most bf16 elements
keep their bits and the XOR of a changed one has zero high bits, so the compressor does the
sparse encoding itself. Measured on SmolLM2-135M bf16 with Adam-sized steps at lr 5e-6 (5.8% of the
elements changed): XOR + zstd wrote 5.9% of the bytes in 0.4 s (zlib level 1: 7.7% in 0.9 s);
shuffling the XOR into byte planes first saved 7% more bytes for 2.8 times the time, and in fp32
(every element changes) it lost bytes, so it is not done. On the main job's real updates a bf16
delta is 1.6-2.0% of a full snapshot; an fp32 one 45-47% (every element changes its low bits each
step, so deltas pay off far less there: see docs/concepts.md).

Codec: zstd (the ``zstandard`` package, in the ``cpu`` extra) where installed, else zlib (standard
library; the GPU machine lacks zstandard): the manifest names the codec, and an engine without it
refuses the delta by name.

Applying (:func:`stage_from_delta`, through ``engine.weights.update_from_disk`` or the server's
``/update_weights_from_disk`` on the folder): the manifest is read and checked whole (format,
``base_version`` equal to the version the engine serves, every name, dtype and shape against the
model, every frame inside ``delta.bin`` of the stated size) before any byte is decoded; then each
frame's checksum is checked, it is decompressed straight into the tensor's staging buffer, XORed
with the live tensor, and the result's checksum compared with the manifest's. So a corrupt,
truncated or partial delta (a missing manifest or data file), a delta for another version and an
engine whose weights are not the base all raise ``WeightUpdateError`` while staging: the engine
keeps its weights and version. The commit checks ``base_version`` again (an update committed in
between would make the delta wrong).

Not guaranteed: that ``delta.json`` itself is authentic (it is trusted as the trainer wrote it;
a flipped byte in it is caught only where it changes a checksum, offset, size or name); deltas
need the engine's dtype (the trainer writes them in it: a delta in another dtype is refused).
"""

from __future__ import annotations

import json
import mmap
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from noria.engine.weights import (
    ST_DTYPES,
    ST_NAMES,
    WeightStage,
    WeightUpdateError,
    dtype_name,
    tensor_checksum,
)

MANIFEST = "delta.json"
DATA = "delta.bin"
FORMAT = "noria-delta"
FORMAT_VERSION = 1
ZSTD_LEVEL = 1
"""Measured on SmolLM2-135M's XORs at lr 5e-6: as small as level 3 (zstd's default) in bf16 and
faster; in fp32 level 3 was 6% smaller but three times slower."""
ZLIB_LEVEL = 1
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Integer dtype of each element size: the XOR works on bit patterns."""


def _zstd() -> Any:
    try:
        import zstandard

        return zstandard
    except ImportError:
        return None


def default_codec() -> str:
    """``zstd`` where the ``zstandard`` package is installed, else ``zlib``."""
    return "zstd" if _zstd() is not None else "zlib"


def compress(data: memoryview | bytes, codec: str) -> bytes:
    if codec == "zstd":
        return _zstd().ZstdCompressor(level=ZSTD_LEVEL).compress(data)
    return zlib.compress(data, ZLIB_LEVEL)


def decompress_into(frame: memoryview, codec: str, out: torch.Tensor, name: str) -> None:
    """Decompress ``frame`` into the bytes of contiguous CPU tensor ``out``: exactly its size, or raise."""
    want = out.numel() * out.element_size()
    dest = out.reshape(-1).view(torch.uint8).numpy()
    zstd = _zstd()
    corrupt = (zlib.error,) + ((zstd.ZstdError,) if zstd is not None else ())
    try:
        if codec == "zstd":
            n = 0
            with zstd.ZstdDecompressor().stream_reader(frame) as reader:
                while n < want and (k := reader.readinto(dest[n:])):
                    n += k
                extra = reader.read(1)
        else:
            d = zlib.decompressobj()
            raw = d.decompress(frame, want)
            n, extra = len(raw), b"" if d.eof else b"?"
            dest[:n] = memoryview(raw)
    except corrupt as e:
        raise WeightUpdateError(f"weight delta: tensor '{name}' does not decompress ({codec}): {e}") from e
    if n != want or extra:
        raise WeightUpdateError(f"weight delta: tensor '{name}' decompresses to {'more than' if n == want else n} bytes, not {want}")


def xor_(out: torch.Tensor, other: torch.Tensor) -> None:
    """``out ^= other`` on the bit patterns (same dtype and shape)."""
    view = INT_VIEW[out.element_size()]
    out.view(view).bitwise_xor_(other.view(view))


# -------------------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class DeltaEntry:
    """One changed tensor of a delta."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    encoding: str
    """``xor`` (against the base) or ``raw`` (the new bytes)."""
    offset: int
    """Byte offset of its compressed frame in ``delta.bin``."""
    length: int
    data_checksum: str
    """Checksum of the frame (as a uint8 tensor)."""
    checksum: str
    """Checksum of the tensor the frame makes."""

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": ST_NAMES[self.dtype], "shape": list(self.shape), "encoding": self.encoding,
                "offset": self.offset, "length": self.length, "data_checksum": self.data_checksum, "checksum": self.checksum}  # fmt: skip


@dataclass(frozen=True)
class Manifest:
    """``delta.json`` of a delta folder."""

    version: int
    base_version: int
    codec: str
    checksum_algo: str
    data_bytes: int
    unchanged: int
    entries: list[DeltaEntry]

    def as_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "format_version": FORMAT_VERSION, "version": self.version, "base_version": self.base_version,
                "codec": self.codec, "checksum_algo": self.checksum_algo, "data_file": DATA, "data_bytes": self.data_bytes,
                "unchanged": self.unchanged, "tensors": [e.as_json() for e in self.entries]}  # fmt: skip


def is_delta(folder: str | Path) -> bool:
    """A delta folder (or what is left of one: either file), not a safetensors checkpoint."""
    folder = Path(folder)
    return (folder / MANIFEST).exists() or (folder / DATA).exists()


def read_manifest(folder: str | Path) -> Manifest:
    """The manifest, checked whole: format, codec available, every frame inside ``delta.bin``."""
    folder = Path(folder)
    where = f"weight delta {folder}"
    if not (folder / MANIFEST).is_file():
        raise WeightUpdateError(f"{where}: no {MANIFEST} (a partial delta: the manifest is written last)")
    try:
        doc = json.loads((folder / MANIFEST).read_text())
        if doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
            raise WeightUpdateError(f"{where}: format {doc.get('format')!r} v{doc.get('format_version')!r}, expected {FORMAT!r} v{FORMAT_VERSION}")
        entries = [_entry(t) for t in doc["tensors"]]
        manifest = Manifest(int(doc["version"]), int(doc["base_version"]), str(doc["codec"]), str(doc["checksum_algo"]),
                            int(doc["data_bytes"]), int(doc.get("unchanged", 0)), entries)  # fmt: skip
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise WeightUpdateError(f"{where}: unreadable {MANIFEST}: {type(e).__name__}: {e}") from e
    if manifest.codec not in ("zstd", "zlib") or (manifest.codec == "zstd" and _zstd() is None):
        raise WeightUpdateError(f"{where}: codec {manifest.codec!r} is not available here (zstd needs `pip install zstandard`)")
    data = folder / DATA
    size = data.stat().st_size if data.is_file() else -1
    if size != manifest.data_bytes:
        raise WeightUpdateError(f"{where}: {DATA} has {size if size >= 0 else 'no'} bytes, the manifest says {manifest.data_bytes}: truncated or partial")
    for e in entries:
        if e.offset < 0 or e.length <= 0 or e.offset + e.length > size:
            raise WeightUpdateError(f"{where}: tensor '{e.name}' has a frame [{e.offset}, +{e.length}] outside {DATA} ({size} bytes)")
    return manifest


def _entry(t: dict[str, Any]) -> DeltaEntry:
    encoding = str(t["encoding"])
    if encoding not in ("xor", "raw"):
        raise ValueError(f"tensor {t.get('name')!r}: unknown encoding {encoding!r}")
    return DeltaEntry(str(t["name"]), ST_DTYPES[t["dtype"]], tuple(int(d) for d in t["shape"]), encoding,
                      int(t["offset"]), int(t["length"]), str(t["data_checksum"]), str(t["checksum"]))  # fmt: skip


# -------------------------------------------------------------------------------------- applying


def stage_from_delta(stage: WeightStage, folder: str | Path, served_version: int) -> Manifest:
    """Stage the tensors a delta folder changes (see the module docstring); returns its manifest."""
    manifest = read_manifest(folder)
    if manifest.base_version != served_version:
        raise WeightUpdateError(
            f"weight delta {folder}: it applies to version {manifest.base_version}, the engine serves {served_version} "
            "(an engine that missed a version needs a full snapshot)"
        )
    specs = stage.specs()
    for e in manifest.entries:
        stage.check(e.name, e.dtype, e.shape)
        if e.dtype != specs[e.name][0]:
            raise WeightUpdateError(
                f"weight delta {folder}: tensor '{e.name}' is {dtype_name(e.dtype)}, the engine holds "
                f"{dtype_name(specs[e.name][0])} (a delta applies in the engine's dtype only)"
            )
    fd = os.open(Path(folder) / DATA, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, manifest.data_bytes, prot=mmap.PROT_READ) if manifest.data_bytes else None
    finally:
        os.close(fd)
    try:
        for e in manifest.entries:
            _apply(stage, e, memoryview(mm)[e.offset : e.offset + e.length], manifest, folder)
    finally:
        if mm is not None:
            mm.close()
    return manifest


def _apply(stage: WeightStage, e: DeltaEntry, frame: memoryview, manifest: Manifest, folder: str | Path) -> None:
    """Check one frame, decode it into the staging buffer (or a scratch tensor for a tied alias)."""
    try:
        if frame_checksum(frame, manifest.checksum_algo) != e.data_checksum:
            raise WeightUpdateError(f"weight delta {folder}: tensor '{e.name}': the frame's checksum differs from the manifest's (corrupt)")
        live = stage.tensor(e.name)
        dest = stage.direct_buffer(e.name, e.dtype)  # None: a tied alias already staged
        host = dest if dest is not None and dest.device.type == "cpu" else torch.empty(e.shape, dtype=e.dtype)
        decompress_into(frame, manifest.codec, host, e.name)
        out = host if host is dest else (dest.copy_(host) if dest is not None else host.to(live.device))
        if e.encoding == "xor":
            xor_(out, live)
        if tensor_checksum(out, manifest.checksum_algo) != e.checksum:
            raise WeightUpdateError(
                f"weight delta {folder}: tensor '{e.name}' does not come out as the trainer's version {manifest.version} "
                f"(its base on this engine differs from the trainer's version {manifest.base_version})"
            )
        if dest is None:
            stage.put(e.name, out)
    finally:
        frame.release()


def frame_checksum(frame: bytes | memoryview, algo: str) -> str:
    """Checksum of a compressed frame as the manifest records it (a uint8 tensor's)."""
    return tensor_checksum(torch.frombuffer(bytearray(frame), dtype=torch.uint8), algo)
