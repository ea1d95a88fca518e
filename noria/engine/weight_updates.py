"""The engine's weight-update component: every way to change the served weights, and the version.

``Engine`` owns one :class:`WeightUpdates` (``engine.weights``); the HTTP server's weight API, the
in-process weight-sync target (``noria.sync.targets.LocalTarget``) and tests call it. It owns:

- ``version``: the weight version the engine serves, i.e. the one it tags every sampled token with.
  It changes only at a commit, to the version the update names (the trainer's count of completed
  syncs, see ``noria.loop``); the engine never invents one;
- the staging area (:class:`noria.engine.weights.WeightStage`) and the sources that fill it
  (:mod:`noria.engine.weight_sources`);
- the broadcast groups the engine has joined, by name;
- checksums of the live weights.

Every update is staged, then committed (:mod:`noria.engine.weights`): ``stage*`` calls copy on the
caller's thread while the engine keeps generating; :meth:`commit` swaps the staged buffers in
between two engine steps (through the ``between_steps`` callable the engine gives: it runs a
function on the engine thread with no step in flight), refreshes the runner's packed weights and
drops the prefix cache (its KV was computed with the old weights). The ``update_from_*`` calls are
one-part updates: stage, then commit. ``update_from_disk`` on a weight-delta folder
(:mod:`noria.engine.weight_delta`) stages the changed tensors against the live ones and commits
only if the engine still serves the delta's base version.

What blocks on what: every call blocks its caller (call it through ``asyncio.to_thread`` from async
code). Staging waits for a staging copy in progress (the stage's lock); a commit waits for the
current engine step to end; joining a group waits for the rendezvous (at most ``join_timeout_s``).

Not guaranteed: the weights of a request generating across a commit change between two of its
tokens (each token carries the version that produced it).
"""

from __future__ import annotations

import concurrent.futures
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from noria.engine import weight_delta
from noria.engine import weight_sources as sources
from noria.engine.weights import WeightStage, WeightUpdateError, stage_tensors, tensor_checksum
from noria.process.usage import release_free_memory


class WeightUpdates:
    """The served weights' updates, version and checksums; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        between_steps: Callable[[Callable[[], Any]], Any],
        refresh: Callable[[], None],
        on_commit: Callable[[], None],
        version: int = 0,
    ) -> None:
        """``between_steps(fn)`` runs ``fn`` on the engine thread between two steps and returns its
        result; ``refresh`` re-derives the runner's weights after the parameters moved or changed;
        ``on_commit`` runs after every commit (the engine flushes its prefix cache)."""
        check_version(version)
        self.version = version
        self.device = device
        self.stage_area = WeightStage(model)
        self._between_steps = between_steps
        self._refresh = refresh
        self._on_commit = on_commit
        self._groups: dict[str, Any] = {}

    # ------------------------------------------------------------------------------ one-part updates

    def update_from_state_dict(self, named_tensors: dict[str, torch.Tensor] | Iterable, version: int) -> None:
        """Copy HF-named tensors (a subset is fine) in one update; validates everything first."""
        self._single_update(lambda uid: self.stage(named_tensors, uid), version)

    def update_from_disk(self, folder: str | Path, version: int) -> None:
        """Load a safetensors folder (HF names; a subset is fine): every header is checked, then every
        tensor is read into staging, then swapped in. Or apply a weight-delta folder to the version
        served (:mod:`noria.engine.weight_delta`). A bad or unreadable folder changes nothing."""
        if weight_delta.is_delta(folder):
            self._delta_update(folder, version)
        else:
            self._single_update(lambda uid: self.stage_from_disk(folder, uid), version)

    def _delta_update(self, folder: str | Path, version: int) -> None:
        """Stage a delta against the served weights, then commit it if they are still its base."""
        check_version(version)
        update_id = f"delta-{uuid.uuid4().hex}"
        with self.stage_area.transaction(update_id) as stage:
            manifest = weight_delta.stage_from_delta(stage, folder, self.version)
            if manifest.version != version:
                raise WeightUpdateError(f"weight delta {folder} makes version {manifest.version}, the update names {version}")
        if manifest.entries:
            self.commit(update_id, version, base_version=manifest.base_version)
            return
        self.stage_area.discard(update_id)

        def same_weights() -> None:  # nothing changed: only the version moves
            _check_base(self.version, manifest.base_version)
            self.version = version

        self._between_steps(same_weights)

    def update_from_ipc(self, handle: dict[str, Any], tensors: list[dict[str, Any]], version: int) -> None:
        """Copy tensors out of another process's shared-memory segment or CUDA IPC buffer
        (see :func:`noria.engine.weight_sources.open_ipc`), in one update."""
        self._single_update(lambda uid: self.stage_from_ipc(handle, tensors, uid), version)

    def update_from_distributed(self, names: list[str], dtypes: list, shapes: list, version: int, group_name: str) -> None:
        """Receive tensors broadcast by rank 0 (in ``names`` order), in one update."""
        self._single_update(lambda uid: self.stage_from_distributed(names, dtypes, shapes, group_name, uid), version)

    def _single_update(self, stage: Callable[[str], int], version: int) -> None:
        check_version(version)
        update_id = f"single-{uuid.uuid4().hex}"
        stage(update_id)
        self.commit(update_id, version)

    # ------------------------------------------------------------------------------ staging

    def stage(self, named_tensors: dict[str, torch.Tensor] | Iterable, update_id: str) -> int:
        """Stage part of update ``update_id``; the model is untouched until :meth:`commit`. Returns
        the number of tensors staged."""
        with self.stage_area.transaction(update_id) as stage:
            return stage_tensors(stage, named_tensors)

    def stage_from_disk(self, folder: str | Path, update_id: str) -> int:
        with self.stage_area.transaction(update_id) as stage:
            return sources.stage_from_folder(stage, folder)

    def stage_from_ipc(self, handle: dict[str, Any], tensors: list[dict[str, Any]], update_id: str) -> int:
        """Stage tensors from another process: copied out of its buffer (``shm`` / ``cuda`` handle),
        or, with ``{"kind": "staging"}``, already written into this engine's staging area
        (:meth:`staging_area`) and only checked here."""
        with self.stage_area.transaction(update_id) as stage:
            if isinstance(handle, dict) and handle.get("kind") == "staging":
                size = stage.arena.size if stage.arena is not None else 0
                return stage.mark_written(sources.parse_manifest(tensors, size))
            with sources.open_ipc(handle, self.device) as buf:
                n = sources.stage_from_ipc(stage, buf, sources.parse_manifest(tensors, buf.numel()))
                if buf.device.type == "cuda":  # the sender reuses its buffer once we answer
                    torch.cuda.current_stream(buf.device).synchronize()
                return n

    def staging_area(self, update_id: str) -> dict[str, Any]:
        """Begin update ``update_id`` with its staging buffers in shared memory that a process on
        this machine may write directly (see :class:`noria.engine.weights.SharedArena`): the memfd's
        pid, fd and size, and every tensor's byte offset, dtype and shape. CPU engines only. The first
        call moves the weights into the arena between two steps (one copy)."""
        if self.device.type != "cpu":
            raise WeightUpdateError("a shared staging area exists for CPU engines only; use a CUDA IPC handle")
        if self.stage_area.arena is None:
            self._share()
        with self.stage_area.transaction(update_id) as stage:
            return stage.staging_area()

    def stage_from_distributed(
        self, names: list[str], dtypes: list, shapes: list, group_name: str, update_id: str, chunks: list[int] | None = None
    ) -> int:
        """Receive a bucket broadcast by rank 0 into staging (generation continues meanwhile): one
        broadcast per tensor, or with ``chunks`` one flat broadcast per chunk of tensors
        (:func:`noria.engine.weight_sources.stage_from_broadcast`), received in place on a CPU engine."""
        if group_name not in self._groups:
            raise WeightUpdateError(f"no weight update group named {group_name!r}")
        if chunks is not None and self.device.type == "cpu" and self.stage_area.arena is None:
            self._share()  # staging buffers in parameter order: chunks land in place
        with self.stage_area.transaction(update_id) as stage:
            return sources.stage_from_broadcast(stage, self._groups[group_name], names, dtypes, shapes, self.device, chunks)

    def _share(self) -> None:
        """Move the weights and their staging buffers into a shared arena, between two steps."""

        def share() -> None:
            self.stage_area.share()
            self._refresh()

        self._between_steps(share)

    # ------------------------------------------------------------------------------ commit

    def commit(self, update_id: str, version: int, base_version: int | None = None) -> list[str]:
        """Swap the staged update into the model between two steps and tag it ``version``; returns the
        parameters changed. Generated tokens from the next step on carry the new version. With
        ``base_version`` (a delta), the engine must still serve that version, else nothing changes."""
        check_version(version)

        def apply() -> list[str]:
            if base_version is not None and self.version != base_version:
                self.stage_area.discard(update_id)
                _check_base(self.version, base_version)
            changed = self.stage_area.commit(update_id)
            self._refresh()
            self.version = version
            self._on_commit()
            return changed

        changed = self._between_steps(apply)
        release_free_memory()  # the old weights and staging copies freed: their pages back to the kernel
        return changed

    def discard(self, update_id: str | None = None) -> bool:
        """Drop a staged, uncommitted update (any if None); True if there was one."""
        return self.stage_area.discard(update_id)

    def release(self, live: bool = False) -> None:
        """Free the staging buffers kept between updates (the engine's memory release calls this);
        ``live``: the live weights too, until a full update commits (``WeightStage.release_live``)."""
        if live:
            self.stage_area.release_live()
        else:
            self.stage_area.release()

    @property
    def released(self) -> bool:
        """The live weights are released and no full update has been committed since."""
        return bool(self.stage_area.released)

    # ------------------------------------------------------------------------------ queries

    def specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """dtype and shape of every tensor an update may name (HF names; a tied head included)."""
        return self.stage_area.specs()

    def checksums(self, names: Iterable[str] | None = None, algo: str = "sha256") -> dict[str, str]:
        """``{name: hex digest}`` of the live weights (:func:`noria.engine.weights.tensor_checksum`):
        bitwise exact. Runs on the caller's thread; waits for a staging copy or a commit in progress."""
        names = list(self.specs() if names is None else names)
        with self.stage_area.lock:
            tensors = [self.stage_area.tensor(n) for n in names]
            with concurrent.futures.ThreadPoolExecutor(max(1, min(4, torch.get_num_threads()))) as pool:
                sums = list(pool.map(lambda t: tensor_checksum(t, algo), tensors))
        return dict(zip(names, sums))

    # ------------------------------------------------------------------------------ groups

    def join_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
        join_timeout_s: float = sources.JOIN_TIMEOUT_S,
    ) -> None:
        """Join a broadcast group as rank ``rank_offset`` (the trainer is rank 0). Blocks until all join,
        at most ``join_timeout_s`` (then ``WeightUpdateError``)."""
        if group_name in self._groups:
            raise WeightUpdateError(f"weight update group {group_name!r} already exists")
        self._groups[group_name] = sources.create_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend, join_timeout_s=join_timeout_s
        )

    def leave_group(self, group_name: str) -> None:
        self._groups.pop(group_name, None)


def _check_base(served: int, base_version: int) -> None:
    if served != base_version:
        raise WeightUpdateError(f"weight delta: made against version {base_version}, but the engine now serves {served}")


def check_version(version: Any) -> None:
    """A weight version is a plain int (not a bool)."""
    if not isinstance(version, int) or isinstance(version, bool):
        raise WeightUpdateError(f"weight version must be an integer, got {version!r}")
