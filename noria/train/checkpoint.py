"""Trainer checkpoints with torch.distributed.checkpoint (DCP), committed by a marker file.

Layout of one checkpoint folder (``run_dir/checkpoints/step-000010``)::

    __0_0.distcp ... .metadata    DCP: model + optimizer state, each rank writes its own shards
    trainer_state.json            optimizer_steps, extra (the loop's data cursor, the RL weight version, ...)
    rng-<rank>.pt                 torch / cuda / python / numpy RNG states of each rank, as plain
                                  tensors and numbers (loaded with ``weights_only=True``: a run
                                  folder is data, never code)
    COMMITTED                     written last; a folder without it is never loaded

Write order: every rank writes into a hidden sibling ``.step-000010.partial``; after a barrier
rank 0 writes ``COMMITTED`` and renames the folder into place, then all ranks meet again. A crash at
any point leaves either the previous checkpoints only, or a hidden partial folder that
``latest_checkpoint`` ignores. The schedule has no state of its own: the LR is a function of
the optimizer step count (``noria.train.optim.lr_at``).

Not guaranteed: durability against power loss (no fsync), and multi-node runs need a folder all
ranks share.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from noria import faults
from noria.errors import DiskError
from noria.train.backend import TrainError

MARKER = "COMMITTED"
STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(TrainError):
    """A checkpoint folder is missing, uncommitted or inconsistent."""


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives in a run folder."""
    return Path(run_dir) / "checkpoints" / f"step-{step:06d}"


def is_committed(folder: str | Path) -> bool:
    """Whether ``folder`` is a complete checkpoint."""
    return (Path(folder) / MARKER).is_file()


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The committed checkpoint with the highest step under ``run_dir/checkpoints``, or None."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and is_committed(p)
    ]
    return max(found)[1] if found else None


def save_checkpoint(
    folder: str | Path, model: nn.Module, optimizer: Any, state: dict[str, Any], write: Callable[[Path], None] | None = None
) -> Path:
    """Write model, optimizer, RNG and ``state`` (JSON-able) to ``folder``; collective on all ranks.
    ``write(tmp)``: writes model and optimizer into the uncommitted folder instead of DCP (the
    Megatron backend's dist_checkpointing)."""
    target = Path(folder)
    tmp = target.with_name(f".{target.name}.partial")
    try:
        _write_and_commit(target, tmp, model, optimizer, state, write)
    except Exception as e:
        cause = os_error_in(e)
        if cause is None:
            raise
        if _rank() == 0:  # never trusted, and its bytes are what a full disk needs back
            shutil.rmtree(tmp, ignore_errors=True)
        run = target.parent.parent
        last = latest_checkpoint(run)
        kept = f"; the last committed checkpoint, {last.name}, is intact: --resume {run} continues from it" if last else ""
        raise DiskError(f"{DiskError.writing(tmp, cause, f'saving checkpoint {target.name}')}; the partial folder was removed{kept}") from e
    faults.point("checkpoint.committed")
    _barrier()
    return target


def _write_and_commit(target: Path, tmp: Path, model: nn.Module, optimizer: Any, state: dict[str, Any], write: Any) -> None:
    """Every rank writes into ``tmp``; rank 0 writes the state and the marker, then renames it to ``target``."""
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    if write is not None:
        write(tmp)
    else:
        import torch.distributed.checkpoint as dcp  # here, not at the top: 0.5 s of every trainer's start
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        with _single_process_ok():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
    torch.save(_rng_state(), tmp / f"rng-{rank}.pt")
    _barrier()
    if rank == 0:
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
        faults.point("checkpoint.partial_written")
        (tmp / MARKER).write_text("")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)


def os_error_in(error: BaseException) -> OSError | None:
    """The ``OSError`` behind ``error``: itself, its cause or context, or one of the per-rank failures
    that ``torch.distributed.checkpoint`` wraps a write error in."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        todo += [e.__cause__, e.__context__, *getattr(e, "failures", {}).values()]
    return None


def load_checkpoint(
    folder: str | Path, model: nn.Module, optimizer: Any, read: Callable[[Path], None] | None = None
) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG from a committed checkpoint; return its state.
    ``read(folder)``: restores model and optimizer instead of DCP (pairs with ``save_checkpoint``'s ``write``)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder not found: {folder}")
    if not is_committed(folder):
        raise CheckpointError(
            f"checkpoint {folder} is not committed (no {MARKER} marker): it was interrupted while "
            "being written; use noria.train.checkpoint.latest_checkpoint(run_dir) to find a complete one"
        )
    if read is not None:
        read(folder)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        sd = {"model": model_sd, "optim": optim_sd}
        with _single_process_ok():
            dcp.load(sd, checkpoint_id=str(folder), no_dist=not dist.is_initialized())
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    rng = folder / f"rng-{_rank()}.pt"
    if rng.is_file():  # absent when resuming on more ranks than saved: keep the fresh seeds
        _set_rng_state(_load_rng(rng))
    return json.loads((folder / STATE_FILE).read_text())


@contextlib.contextmanager
def _single_process_ok():
    # DCP warns that it "assumes" single-process intent even when no_dist says so explicitly.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict[str, Any]:
    """Every RNG state as tensors, tuples and numbers only (what ``weights_only`` loading accepts)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _load_rng(path: Path) -> dict[str, Any]:
    """The RNG states in ``path``, unpickled as data only (no object of the file's choosing is built)."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # classify: anything refused here is a bad checkpoint, named
        raise CheckpointError(f"{path}: not a plain-data RNG state ({type(e).__name__}: {str(e)[:300]})") from e


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
