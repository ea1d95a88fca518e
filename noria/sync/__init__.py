"""Weight sync: the trainer's new weights reach every rollout engine, tagged with a version.

What this package owns: moving buckets of ``(HF name, tensor)`` (``FSDPBackend.state_dict_for_sync``)
into engines, checking and timing it, and verifying the result. It is where ``train`` and
``engine`` meet; neither imports the other.

Entry point::

    sync = build_sync(cfg.sync, [engine_or_url, ...], run_dir=RUN_DIR, source=MODEL_DIR)
    metrics = sync.push(backend.state_dict_for_sync(cfg.sync.bucket_mb << 20), version=v)
    sync.close()

Targets: an in-process ``noria.engine.Engine``, an :class:`HttpEngine` (``base_url``, optional API
key) or a URL string. Transports (``sync.transport``; one for all targets):

========== ========================================= ====================================================
transport  in-process ``Engine``                     engine server (``HttpEngine``) on this machine
========== ========================================= ====================================================
ipc        hand the tensors over; the engine copies  write straight into the engine's staging area (a
           them into staging                         memfd it shares); else /dev/shm segments or CUDA
                                                     IPC buffers it copies from (:mod:`noria.sync.ipc`)
broadcast  a gloo/NCCL group; the engine joins it    gloo/NCCL group via /init_weights_update_group and
           in a thread                               /update_weights_from_distributed
disk       a safetensors folder per version, loaded  the same folder via /update_weights_from_disk
           by ``engine.weights.update_from_disk``;   (an external SGLang or vLLM loads it too); with
           with ``sync.delta`` a folder of what      ``sync.delta`` the delta folder, same call (noria
           changed (:mod:`noria.sync.disk`)          engines only)
========== ========================================= ====================================================

``auto`` picks by topology (:func:`resolve_transport`): ipc for in-process engines and for Noria
engine servers on this machine that memory reaches (the trainer's weights or the engine's on the
CPU: shared memory; both on one GPU: CUDA IPC); broadcast for servers on this machine on other
GPUs and for servers that are not Noria engines (SGLang's protocol); disk when a server is on
another machine (a broadcast group's store listens on loopback only); the RL job picks disk for an
external ``engine_url``. Mixed in-process engines and servers need an explicit transport.

Every engine stages a whole update before it changes anything, and commits it as one step (see
``noria.engine.weights``): a push that fails (a tensor of the wrong name, shape or dtype, a
missing or corrupt file or segment, an engine that errors) raises :class:`WeightSyncError` and
leaves each engine's weights bit for bit and its version unchanged. With ``sync.verify`` every
engine must then report the new version and, for every tensor sent, a checksum equal to the
trainer's (exact: a hash of the bytes in the engine's dtype).

Blocking and guarantees: see :class:`noria.sync.weight_sync.WeightSync` and each transport module.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

from noria.config import SyncConfig, ensure_valid
from noria.sync.errors import WeightSyncError
from noria.sync.targets import HttpEngine, LocalTarget, as_target
from noria.models.checkpoint import bucketize
from noria.sync.weight_sync import Transport, WeightSync

TRANSPORTS = ("ipc", "broadcast", "disk")

__all__ = ["HttpEngine", "TRANSPORTS", "WeightSync", "WeightSyncError", "build_sync", "bucketize", "resolve_transport"]


def build_sync(cfg: SyncConfig, targets: list[Any], run_dir: Path | None = None, source: str | Path | None = None,
               device: str | None = None) -> WeightSync:  # fmt: skip
    """A :class:`WeightSync` to ``targets`` with the transport ``cfg.transport`` resolves to
    (``device``: where the trainer's tensors are, for ``auto``; None is the CPU).

    ``run_dir``: the disk transport writes to ``cfg.disk_dir`` or else ``run_dir/weights``.
    ``source``: a model folder whose config.json and tokenizer files go next to the disk
    transport's weights (so that the folder is a complete HF checkpoint)."""
    ensure_valid(cfg)  # once: a loaded config was validated when loaded
    if not targets:
        raise WeightSyncError("weight sync: no engines to push to")
    wrapped = [as_target(t, i) for i, t in enumerate(targets)]
    transport = resolve_transport(cfg.transport, wrapped, device)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2 * len(wrapped) + 2, thread_name_prefix="noria-sync")
    impl = _transport(transport, wrapped, pool, cfg, run_dir, source)
    return WeightSync(impl, wrapped, cfg.verify, pool)


def resolve_transport(name: str, targets: list[Any], device: str | None = None) -> str:
    """An explicit name as is; ``auto`` by where the engines are (module docstring). ``device``: where
    the trainer's tensors are (None: the CPU)."""
    if name in TRANSPORTS:
        return name
    if name != "auto":
        raise WeightSyncError(f"sync.transport must be auto or one of {TRANSPORTS}, got {name!r}")
    local = [isinstance(t, LocalTarget) for t in targets]
    if all(local):
        return "ipc"
    if any(local):
        raise WeightSyncError("sync.transport auto: the engines are both in process and servers; choose ipc, broadcast or disk")
    from noria.net import on_this_machine

    if not all(on_this_machine(t.base_url) for t in targets):
        return "disk"
    specs = [t.specs() for t in targets]
    if any(s is None for s in specs):  # not a Noria engine: SGLang's protocol
        return "broadcast"
    if device is None or not str(device).startswith("cuda"):
        return "ipc"
    from noria.hardware import device_id

    ours = device_id(device)  # a CPU engine (no device id) gets host shared memory: ipc too
    return "ipc" if all(s.device_id in (None, ours) for s in specs) else "broadcast"


def _transport(name: str, targets: list[Any], pool: Any, cfg: SyncConfig, run_dir: Path | None, source: Any) -> Transport:
    if name == "ipc":
        from noria.sync.ipc import IpcTransport

        return IpcTransport(targets, pool)
    if name == "broadcast":
        from noria.sync.broadcast import BroadcastTransport

        return BroadcastTransport(targets, pool, cfg.broadcast_backend)
    from noria.sync.disk import DiskTransport

    if cfg.disk_dir is None and run_dir is None:
        raise WeightSyncError("the disk transport needs sync.disk_dir or a run folder")
    folder = Path(cfg.disk_dir) if cfg.disk_dir is not None else Path(run_dir) / "weights"
    return DiskTransport(targets, pool, folder, Path(source) if source is not None else None, cfg.delta, cfg.bucket_mb << 20)
