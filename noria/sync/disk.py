"""The ``disk`` transport: a safetensors folder per version, loaded by every engine.

What the folder is: ``DIR/v00000012/`` holding ``model.safetensors`` (one bucket) or
``model-0000k-of-0000n.safetensors`` shards (one per bucket) with ``model.safetensors.index.json``,
HF tensor names (MoE experts one tensor each, as HF checkpoints hold them), ``format: pt``
metadata, plus ``config.json`` and the tokenizer files of ``source`` when one is given. So an
external SGLang or vLLM server can load it like any HF checkpoint (``/update_weights_from_disk``,
``reload_weights``).

How data moves::

    trainer:  write each bucket into DIR/.v00000012.partial-<id>/ ─▶ rename it to DIR/v00000012
    engines:  /update_weights_from_disk (or Engine.update_weights_from_disk): check every header,
              read every tensor into staging, swap in as version 12

The rename is the publication: an engine is only ever given a complete folder, and a crashed
trainer leaves a ``.partial`` folder that no engine is pointed at (the next push removes it). A
push that fails removes its folder. After a successful push only the newest :data:`KEEP` version
folders (and as many delta folders) remain. Tensors are written straight from their memory (no serialised copy in between);
CUDA tensors are copied to the host first.

With ``sync.delta`` (noria engines only: :func:`delta_dtypes` refuses any other target when the
sync is built), a push asks every engine which version it serves, then::

    trainer:  the delta against the base (the last version written, :mod:`noria.sync.delta`) into
              DIR/.d00000013.partial-<id>/ ─▶ rename to DIR/d00000013
    engines serving the base: apply it (``noria.engine.weight_delta``)
    the others (first push, restarted, missed a version), and any engine that refused the delta
    (corrupt, or its weights are not the base; it kept them): a full snapshot DIR/v00000013
              written from the base, as above

A full snapshot rather than the chain of deltas since the engine's version: it is bounded (one
model's bytes, written only when some engine needs it, once for all of them), needs no history of
deltas kept on disk, and a restarted engine holds the original weights, which no delta chain
starts from anyway. Metrics of a push (``WeightSync.push`` adds them): ``sync/bytes_written``
(both kinds), ``sync/changed_frac``, ``sync/full_snapshots``, ``sync/delta_refused``.

Blocking: ``send`` writes on the calling thread, then waits for every engine to load. Not
guaranteed: durability across a power loss (no fsync); that engines on other machines see ``DIR``
(it must be a shared filesystem for them); deltas for SGLang or vLLM (they load only complete HF
folders: use full snapshots, ``sync.delta: false``).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from noria.models.checkpoint import bucketize
from noria.sync.delta import DeltaBase, DeltaStats
from noria import faults
from noria.errors import DiskError
from noria.sync.errors import WeightSyncError
from noria.sync.weight_sync import Bucket, Transport, for_each

KEEP = 2
"""Version folders kept after a successful push (the newest ones; as many delta folders)."""
VERSION_DIR = re.compile(r"^v\d{8}$")
DELTA_DIR = re.compile(r"^d\d{8}$")
log = logging.getLogger(__name__)


class DiskTransport(Transport):
    name = "disk"

    def __init__(self, targets: list[Any], pool: concurrent.futures.ThreadPoolExecutor, folder: Path, source: Path | None = None,
                 delta: bool = False, bucket_bytes: int = 256 << 20) -> None:  # fmt: skip
        """``delta``: write deltas against the last version (every target must apply them: asked
        here, so that a config that cannot work stops at start); ``bucket_bytes``: the shard size
        of a full snapshot written from the base."""
        super().__init__(targets, pool)
        self.folder = Path(folder)
        self.source = Path(source) if source is not None else None
        self.last_folder: Path | None = None
        self.bucket_bytes = bucket_bytes
        self.base = DeltaBase(delta_dtypes(targets, pool)) if delta else None
        self.push_metrics: dict[str, float] = {}

    def send(self, buckets: Iterator[Bucket], version: int, update_id: str) -> None:
        if self.base is not None:
            self._send_delta(buckets, version)
            return
        final = self.write(buckets, version)
        try:
            for_each(self.pool, self.targets, lambda t: t.load_disk(final, version))
        except BaseException:
            shutil.rmtree(final, ignore_errors=True)
            raise
        self.push_metrics = {"sync/bytes_written": float(_folder_bytes(final))}
        self.last_folder = final
        self._prune()

    def _send_delta(self, buckets: Iterator[Bucket], version: int) -> None:
        """Engines serving the base get the delta; the others, and any that refuses it, a full
        snapshot written from the (new) base."""
        served = for_each(self.pool, self.targets, lambda t: t.version())
        on_base = [t for t, v in zip(self.targets, served) if self.base.version is not None and v == self.base.version]
        written: list[Path] = []
        try:
            delta, stats = self._write_delta(buckets, version, bool(on_base))
            written += [delta] if delta is not None else []
            refused = [t for t in for_each(self.pool, on_base, lambda t: _load_or_refuse(t, delta, version)) if t is not None]
            need_full = [t for t in self.targets if t not in on_base] + refused
            if need_full:
                full = self.write(bucketize(self.base.tensors, self.bucket_bytes), version)
                written.append(full)
                for_each(self.pool, need_full, lambda t: t.load_disk(full, version))
        except BaseException:
            for folder in written:
                shutil.rmtree(folder, ignore_errors=True)
            raise
        self.push_metrics = {
            "sync/bytes_written": float(sum(_folder_bytes(f) for f in written)),
            "sync/changed_frac": stats.changed / max(stats.elements, 1),
            "sync/full_snapshots": float(len(need_full)),
            "sync/delta_refused": float(len(refused)),
        }
        self.last_folder = written[-1] if written else None
        self._prune()

    def _write_delta(self, buckets: Iterator[Bucket], version: int, encode: bool) -> tuple[Path | None, DeltaStats]:
        """The delta folder ``DIR/dNNNNNNNN`` (published by one rename), or with ``encode`` False
        only the base updated (no engine serves the base: none could use a delta)."""
        if not encode:
            return None, self.base.write(None, buckets, version)
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.folder / f"d{version:08d}"
        tmp = self.folder / f".{final.name}.partial-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            stats = self.base.write(tmp, buckets, version)
            _publish(tmp, final)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError):
                raise DiskError.writing(tmp, e, f"the weight push of version {version} (a delta)") from e
            raise
        return final, stats

    def write(self, buckets: Iterator[Bucket], version: int) -> Path:
        """Write the buckets as a complete folder ``DIR/vNNNNNNNN`` (published by one rename)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob(".[vd]*.partial-*"):  # left by a crashed push
            shutil.rmtree(stale, ignore_errors=True)
        final = self.folder / f"v{version:08d}"
        tmp = self.folder / f".{final.name}.partial-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            parts = [write_safetensors(tmp / f"part-{k}.safetensors", hf_layout(bucket)) for k, bucket in enumerate(buckets)]
            faults.point("sync.disk_write")
            _name_shards(tmp, parts)
            self._companions(tmp)
            _publish(tmp, final)
        except BaseException as e:  # the engines keep the version they serve; nothing half-written stays
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError):
                raise DiskError.writing(tmp, e, f"the weight push of version {version}") from e
            raise
        return final

    def _companions(self, folder: Path) -> None:
        if self.source is None:
            return
        from noria.models.checkpoint import COMPANION_FILES, CONFIG_FILE

        for name in (CONFIG_FILE, *COMPANION_FILES):
            if (self.source / name).is_file():
                shutil.copy2(self.source / name, folder / name)

    def _prune(self) -> None:
        for kind in (VERSION_DIR, DELTA_DIR):
            versions = sorted(p for p in self.folder.iterdir() if p.is_dir() and kind.match(p.name))
            for old in versions[:-KEEP]:
                shutil.rmtree(old, ignore_errors=True)


def delta_dtypes(targets: list[Any], pool: concurrent.futures.ThreadPoolExecutor) -> dict[str, torch.dtype]:
    """The dtype every target holds each tensor in (deltas are made in it); raises for a target
    that cannot apply deltas (not a noria engine: SGLang and vLLM load only full HF folders) or
    targets that disagree on a dtype."""
    specs = for_each(pool, targets, lambda t: t.specs())
    dtypes: dict[str, torch.dtype] = {}
    for target, spec in zip(targets, specs):
        if spec is None:
            raise WeightSyncError(
                f"sync.delta: engine {target.name} cannot apply weight deltas (only noria engines can; SGLang and vLLM "
                "load full HF folders): set sync.delta false"
            )
        for name, (dtype, _) in spec.tensors.items():
            if dtypes.setdefault(name, dtype) != dtype:
                raise WeightSyncError(f"sync.delta: the engines hold tensor '{name}' in different dtypes ({dtypes[name]}, {dtype})")
    return dtypes


def _load_or_refuse(target: Any, folder: Path, version: int) -> Any:
    """Load the delta; the target if it refused it (it kept its weights: it gets a full snapshot)."""
    try:
        target.load_disk(folder, version)
    except WeightSyncError as e:
        log.warning("weight sync: %s refused the delta for version %d (%s); sending it a full snapshot", target.name, version, e)
        return target
    return None


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def hf_layout(bucket: Bucket) -> Bucket:
    """The bucket with HF checkpoint names: a MoE model's stacked experts as one tensor per expert
    (``noria.models.moe.disk_layout``, views: no copy), so other servers load the folder too."""
    from noria.models.moe import disk_layout

    return list(disk_layout(dict(bucket)).items())


def write_safetensors(path: Path, bucket: Bucket) -> tuple[Path, list[str], int]:
    """Write one safetensors file straight from the tensors' memory; returns (path, names, bytes)."""
    from noria.engine.weights import ST_NAMES

    header: dict[str, Any] = {}
    data, offset = [], 0
    for name, t in bucket:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.dtype not in ST_NAMES:
            raise WeightSyncError(f"tensor '{name}': dtype {t.dtype} has no safetensors name")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        data.append(t)
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in data:
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)
    return path, [name for name, _ in bucket], offset


def _name_shards(folder: Path, parts: list[tuple[Path, list[str], int]]) -> None:
    """Rename the parts as transformers names them and write the index for several."""
    if not parts:
        raise WeightSyncError("the update holds no tensors")
    if len(parts) == 1:
        parts[0][0].rename(folder / "model.safetensors")
        return
    weight_map, total = {}, 0
    for k, (path, names, size) in enumerate(parts, start=1):
        shard = f"model-{k:05d}-of-{len(parts):05d}.safetensors"
        total += size
        path.rename(folder / shard)
        weight_map.update({n: shard for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _publish(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` (a retried version) is moved aside first."""
    if final.exists():
        aside = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(final, aside)
        os.rename(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, final)
