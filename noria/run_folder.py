"""The run folder of ``noria train`` (RL and SFT alike): where a run's files go, and the checks and
moves before a run touches it.

A run writes everything it produces into one folder: ``noria train CONFIG --run-dir DIR`` (default
``runs/<config name>-<time>``) holds the resolved config (``config.yaml``), ``metrics.jsonl``,
``events.jsonl`` (each start of a run on the folder, ``noria.metrics.record_event``),
``checkpoints/``, sampled trajectories (``rollouts/``, RL) and the final model (``final/``);
``--resume DIR`` continues it. This module owns the folder's name and these rules:

- a fresh run refuses a folder that already holds a run (metrics or a committed checkpoint);
- a resumed run needs something to continue from (``check_continuable``): a committed checkpoint
  (a finished run saves one at its end: ``train.save_final_state``), or a folder that records
  nothing yet. Otherwise it is refused before anything is written, the error naming what would be
  lost and the two ways on: a new run from ``RUN/final`` (``--model.path``), or ``--restart``;
- a resumed run needs the same config as saved, except ``RESUME_MAY_CHANGE`` (a run may be
  extended); the error names every key that differs. ``noria train --resume RUN`` without a config
  file loads the run's own (``saved_config``), overrides applied on top;
- nothing a run recorded is deleted by a later run on the folder. A resume from step k moves what
  was recorded after k (metrics and eval rows, a line cut short by a crash, rollouts and eval
  files of later steps) into ``superseded/after-step-k-<time>/`` (``set_aside_after``), and the
  resumed run repeats exactly the steps it lost; ``--restart`` moves every record of the folder
  into ``previous-<time>/`` (``move_aside``) and starts again from step 0;
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
from noria.metrics import read_jsonl, record_event
from noria.train.checkpoint import latest_checkpoint

RESUME_MAY_CHANGE = ("run_dir", "train.max_steps", "train.save_final_state")
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


IMAGES = "images"
"""The run folder's image store: a vision-language run's images, each once, named by content hash."""


def save_images(folder: Path, refs: list[str]) -> int:
    """Write the run's images ``refs`` (in this process's image store, ``noria.data.images``) not yet
    in the run folder's ``images/``; returns how many were written (0 for a run without images).
    Only the run's own: the store is the process's, and may hold other runs' images."""
    from noria.data.images import default_store

    return default_store().save(folder / IMAGES, refs) if refs else 0


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
    """A fresh run needs a folder without a run in it; a resumed one, something to continue from and
    the same config as saved; both, a folder they can write. Reads only: a refused run wrote nothing."""
    check_writable(folder)
    if resume:
        check_continuable(folder)
        check_same_config(folder, config)
    elif (folder / "metrics.jsonl").exists() or latest_checkpoint(folder) is not None:
        raise NoriaError(
            f"run folder {folder} already holds a run: continue it with --resume {folder}, start it again there from "
            f"step 0 with --run-dir {folder} --restart (its records move to {folder / PREVIOUS}<time>/), or pick another --run-dir"
        )


def check_continuable(folder: Path) -> None:
    """``NoriaError`` when ``--resume folder`` has nothing to continue from: no committed checkpoint,
    while the folder records steps or a model that a run from step 0 would replace. The message
    names those records and the two ways on (a new run from ``final/``, or ``--restart``)."""
    if latest_checkpoint(folder) is not None:
        return
    records = recorded(folder)
    if not records:
        return  # nothing recorded yet (a run stopped before its first step): step 0 loses nothing
    ways = []
    if (folder / "final").is_dir():
        ways.append(f"start a new run from its model: noria train {folder / 'config.yaml'} --model.path {folder / 'final'} "
                    "--run-dir NEW_DIR (with your overrides)")  # fmt: skip
    ways.append(f"start this run again from step 0 in {folder}, its records moved (never deleted) to "
                f"{folder / PREVIOUS}<time>/: noria train --resume {folder} --restart (with your overrides)")  # fmt: skip
    raise NoriaError(
        f"--resume {folder}: nothing to continue from: no committed checkpoint in {folder / 'checkpoints'} (it saved none: "
        "it ran with train.save_final_state false, or before that key existed, or stopped before its first checkpoint); a run "
        f"from step 0 would replace {', '.join(records)}. Nothing was written. Instead, {'; or '.join(ways)}"
    )


def recorded(folder: Path) -> list[str]:
    """What ``folder`` records of a run, in words (``[]``: nothing): step rows, evaluations, rollouts, the model."""
    out = []
    steps = len([r for r in read_jsonl(folder / "metrics.jsonl") if "step" in r])
    evals = len(read_jsonl(folder / "eval.jsonl"))
    rollouts = len(list((folder / "rollouts").glob("step-*.jsonl")))
    for count, name, what in ((steps, "metrics.jsonl", "step"), (evals, "eval.jsonl", "evaluation"), (rollouts, "rollouts/", "step")):
        if count:
            out.append(f"{name} ({count} {what}{'s' if count > 1 else ''})")
    if (folder / "final").is_dir():
        out.append(f"final/ (the model{f' of step {steps}' if steps else ''})")
    return out


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


SUPERSEDED = "superseded"
"""Where a resume moves what was recorded after the step it resumes from: ``superseded/after-step-k-<time>/``."""
PREVIOUS = "previous-"
"""``--restart`` moves a run's records into ``previous-<time>/`` inside its folder."""
STEP_FILES = ("rollouts", "eval")
"""Folders of per-step files (``step-000003.jsonl``, ``.png``) that a resumed run writes again."""


def set_aside_after(folder: Path, step: int) -> tuple[dict[str, int], Path | None]:
    """Before a run resumes from ``step``: move what it recorded after that step into
    ``superseded/after-step-<step>-<time>/`` (same names inside): the rows of metrics.jsonl and
    eval.jsonl past ``step`` (and a line cut short by a crash), and the files of later steps in
    rollouts/ and eval/. Returns ({what: count moved}, the folder, or None when nothing was)."""
    target = unique(folder / SUPERSEDED / f"after-step-{step}-{time.strftime('%Y%m%d-%H%M%S')}")
    moved = {}
    for name in ("metrics.jsonl", "eval.jsonl"):
        if n := move_rows_after(folder / name, step, target / name):
            moved[name] = n
    for sub in STEP_FILES:
        later = [p for p in sorted((folder / sub).glob("step-*")) if p.is_file() and step_of(p) > step]
        for path in later:
            (target / sub).mkdir(parents=True, exist_ok=True)
            path.rename(target / sub / path.name)
        if later:
            moved[f"{sub}/"] = len(later)
    return moved, (target if moved else None)


def move_rows_after(path: Path, step: int, side: Path) -> int:
    """Move the lines of ``path`` whose step is past ``step`` (and lines that are not whole JSON) to
    ``side``, keeping the rest in order; the side file is written before ``path`` is cut. Returns the count."""
    if not path.is_file():
        return 0
    kept, moved = [], []
    for line in path.read_text().splitlines(keepends=True):
        try:
            row_step = json.loads(line).get("step", math.inf)
        except (json.JSONDecodeError, AttributeError):
            row_step = math.inf
        (kept if row_step <= step else moved).append(line if line.endswith("\n") else line + "\n")
    if moved:
        side.parent.mkdir(parents=True, exist_ok=True)
        side.write_text("".join(moved))
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text("".join(kept))
        os.replace(partial, path)
    return len(moved)


def step_of(path: Path) -> int:
    """The step of a per-step file (``step-000003.jsonl`` -> 3; -1 when the name holds none)."""
    digits = path.name.split(".")[0].removeprefix("step-")
    return int(digits) if digits.isdigit() else -1


def unique(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``... : the first that does not exist (two moves in one second)."""
    n, out = 1, path
    while out.exists():
        n += 1
        out = path.with_name(f"{path.name}-{n}")
    return out


def restart_folder(resume: str | None, run_dir: str | None) -> Path:
    """The folder ``--restart`` starts again: ``--resume RUN`` or ``--run-dir RUN`` (the same one if both)."""
    if resume is None and run_dir is None:
        raise NoriaError("--restart needs the run folder: noria train [CONFIG] --resume RUN_DIR --restart")
    if resume is not None and run_dir is not None and Path(run_dir).resolve() != Path(resume).resolve():
        raise NoriaError(f"--run-dir {run_dir} and --resume {resume} name different run folders")
    return Path(resume or run_dir)


def move_aside(folder: Path) -> Path | None:
    """``--restart``: move every entry of ``folder`` (config, metrics, events, checkpoints, final/, ...;
    not the ``previous-*`` folders of earlier restarts) into ``previous-<time>/`` inside it, then
    record the restart in a new events.jsonl. Returns that folder, or None when there was nothing to move."""
    entries = sorted(p for p in folder.iterdir() if not p.name.startswith(PREVIOUS)) if folder.is_dir() else []
    if not entries:
        return None
    check_writable(folder)
    steps = [int(r["step"]) for r in read_jsonl(folder / "metrics.jsonl") if isinstance(r.get("step"), int)]
    target = unique(folder / f"{PREVIOUS}{time.strftime('%Y%m%d-%H%M%S')}")
    target.mkdir(mode=0o700)
    for path in entries:
        path.rename(target / path.name)
    record_event(folder, "restarted", 0, moved_to=target.name, previous_last_step=max(steps, default=0))
    return target


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
    return latest_checkpoint(folder) is not None or any("step" in r for r in read_jsonl(folder / "metrics.jsonl"))
