"""Evaluation snapshots: the policy's weights at one step, exported as a committed HF folder.

Layout (in the run folder)::

    eval_snapshots/step-000010/   config.json, model.safetensors, tokenizer files (backend.export_hf)
                                  COMMITTED   written last (noria.train.checkpoint's marker)

What it owns: where a step's snapshot lives, writing it so that a reader never sees half a folder
(the trainer exports into a hidden sibling ``.step-000010.partial``, writes the marker, then renames
it into place, as checkpoints do), checking one before use, and removing it when its evaluation is
over. ``eval.mode fleet`` loads it into the evaluation engines; ``eval.mode checkpoint`` hands it to
the backend.

What blocks on what: ``export_snapshot`` runs the trainer's export (it gathers every parameter), so
the caller runs it between training steps, never while ``train`` runs.

Not guaranteed: durability against power loss (no fsync); snapshots of a run that was killed stay
on disk until the folder is removed.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from noria.errors import NoriaError
from noria.train.checkpoint import MARKER  # one marker for every committed folder


class SnapshotError(NoriaError):
    """A snapshot is missing or was not committed."""


def snapshot_dir(run_dir: str | Path, step: int) -> Path:
    """Where the evaluation snapshot of ``step`` lives."""
    return Path(run_dir) / "eval_snapshots" / f"step-{step:06d}"


def export_snapshot(backend: Any, run_dir: str | Path, step: int) -> Path:
    """Export the trainer's weights (``backend.export_hf``) as the committed snapshot of ``step``."""
    target = snapshot_dir(run_dir, step)
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # a previous attempt that died half way
    shutil.rmtree(target, ignore_errors=True)  # a resumed run measures this step again
    backend.export_hf(partial)
    (partial / MARKER).write_text(f"{step}\n")
    partial.rename(target)
    return target


def check_snapshot(folder: Path) -> Path:
    """``folder`` if it is a committed snapshot; ``SnapshotError`` naming it otherwise."""
    if not folder.is_dir():
        raise SnapshotError(f"missing snapshot: {folder} does not exist")
    if not (folder / MARKER).is_file():
        raise SnapshotError(f"missing snapshot: {folder} has no {MARKER} marker (export did not finish)")
    return folder


def remove_snapshot(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
