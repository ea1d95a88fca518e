"""The run folder of ``noria train`` (RL and SFT alike): where a run's files go, and the resume checks.

A run writes everything it produces into one folder: ``noria train CONFIG --run-dir DIR`` (default
``runs/<config name>-<time>``) holds the resolved config (``config.yaml``), ``metrics.jsonl``,
``checkpoints/``, sampled trajectories (``rollouts/``, RL) and the final model (``final/``);
``--resume DIR`` continues it. This module owns the folder's name and the checks before a run
touches it:

- a fresh run refuses a folder that already holds a run (metrics or a committed checkpoint);
- a resumed run needs the same config as saved, except ``RESUME_MAY_CHANGE`` (a run may be
  extended); the error names every key that differs. ``noria train --resume RUN`` without a config
  file loads the run's own (``saved_config``), overrides applied on top;
- after a resume, metrics lines written past the checkpoint are dropped
  (``keep_metrics_through``), so the resumed run repeats exactly the steps it lost;
- a fresh run that fails before its first step is recorded leaves no folder behind
  (``discard_unstarted``), so the same ``--run-dir`` can be used again at once.

Not guaranteed: two runs started at once on one folder are not detected (nothing is locked).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from noria.config import RunConfig, to_dict
from noria.errors import NoriaError
from noria.train.checkpoint import latest_checkpoint

RESUME_MAY_CHANGE = ("run_dir", "train.max_steps")
"""Config keys a resumed run may set differently from the saved config."""


def resolve_run_dir(config: RunConfig, run_dir: str | None, resume: str | None) -> Path:
    """The run folder: --resume, else --run-dir, else config.run_dir, else runs/<name>-<time>."""
    if resume is not None and run_dir is not None and Path(run_dir).resolve() != Path(resume).resolve():
        raise NoriaError(f"--run-dir {run_dir} and --resume {resume} name different run folders")
    folder = resume or run_dir or config.run_dir or f"runs/{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return Path(folder)


def make_run_folder(folder: Path) -> None:
    """Create the run folder (and its parents) readable by its owner only (0700): it holds the
    resolved config, every trajectory, checkpoints and the model. ``noria train`` also runs with
    umask 077, so the files in it are 0600."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)


def check_writable(folder: Path) -> None:
    """``NoriaError`` when the run folder (or, not made yet, the nearest folder above it) cannot be
    written: a read-only file system or no permission. Checked before any model loads."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "is on a read-only file system" if _read_only(existing) else "is not writable by this user"
        where = "" if existing == folder else f" ({existing}, where it would be made,)"
        raise NoriaError(f"run folder {folder}{where} {why}: the run could save nothing; pick another --run-dir")


def _read_only(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def check_run_folder(folder: Path, config: RunConfig, resume: bool) -> None:
    """A fresh run needs a folder without a run in it; a resumed one, the same config as saved; both,
    a folder they can write."""
    check_writable(folder)
    if resume:
        check_same_config(folder, config)
    elif (folder / "metrics.jsonl").exists() or latest_checkpoint(folder) is not None:
        raise NoriaError(f"run folder {folder} already holds a run: continue it with --resume {folder}, or pick another --run-dir")


def saved_config(folder: str | Path) -> Path:
    """The run's own resolved config (``RUN/config.yaml``): what ``noria train --resume RUN`` loads
    when no config file is given."""
    path = Path(folder) / "config.yaml"
    if not path.is_file():
        raise NoriaError(f"--resume {folder}: no config.yaml there, so it is not a run folder")
    return path


def check_same_config(folder: Path, config: RunConfig) -> None:
    """Raise unless ``config`` equals the run's saved config outside ``RESUME_MAY_CHANGE``; the
    error names every key that differs, with both values."""
    saved = flatten(yaml.safe_load(saved_config(folder).read_text()))
    now = flatten(to_dict(config))
    changed = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k) and k not in RESUME_MAY_CHANGE)
    if changed:
        detail = "; ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed)
        raise NoriaError(
            f"--resume {folder}: the config differs from the run's config.yaml in {len(changed)} "
            f"key{'s' if len(changed) > 1 else ''} ({detail}); resume without a config file to use the run's own"
        )


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections -> ``{"a.b": value}``."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "task_args":
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def keep_metrics_through(path: Path, step: int) -> None:
    """Drop metrics lines of steps after ``step`` (and a line cut short by a crash)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("step", math.inf) <= step:
            kept.append(line + "\n")
    path.write_text("".join(kept))


@contextmanager
def discard_unstarted(folder: Path, resume: bool) -> Iterator[None]:
    """Around a run: if it raises (Ctrl-C included) before recording a step, remove ``folder``
    when this run created it. A resumed run's folder, or one that existed before (it may hold the
    user's own files), is never removed; nor is one with a step row or a checkpoint in it."""
    created = not resume and not folder.exists()
    try:
        yield
    except BaseException:
        if created and folder.is_dir() and not has_steps(folder):
            shutil.rmtree(folder, ignore_errors=True)
        raise


def has_steps(folder: Path) -> bool:
    """Whether a run folder records at least one step: a committed checkpoint or a step row in metrics.jsonl."""
    if latest_checkpoint(folder) is not None:
        return True
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():
        return False
    for line in metrics.read_text().splitlines():
        try:
            if "step" in json.loads(line):
                return True
        except json.JSONDecodeError:
            continue
    return False
