"""The segments of a run: each start of ``noria train`` on its folder, and what it recorded.

Read from ``RUN_DIR/events.jsonl`` (one line per start: ``started``, ``resumed`` or ``restarted``
with ``at_step``, written by ``noria.metrics.record_event``) and the steps of ``metrics.jsonl``. A
run resumed k times is one curve of k + 1 segments: segment i holds the steps after its start, up
to the step the next one resumed from (a resume from step s moved what was recorded after s into
``superseded/``, so every step has one row). ``noria report`` marks each resume on its plots and
lists the segments; ``noria inspect`` says which segment a step belongs to. A ``--restart`` moved
the earlier run, whole, into ``previous-<time>/`` (itself a run folder both commands read).

A folder without events.jsonl (runs from before it existed, or a copy without it) is one segment.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from noria.metrics import read_jsonl


@dataclass(frozen=True)
class Segment:
    """One start of ``noria train`` on a run folder and the steps it recorded."""

    event: str
    """``started`` (step 0) or ``resumed``."""
    at_step: int
    """The step it started from (the checkpoint's step when resumed)."""
    steps: tuple[int, ...]
    """The steps of metrics.jsonl this segment recorded (empty: it stopped before its first)."""
    time: float | None = None
    """Unix time of the start."""
    detail: dict[str, Any] = field(default_factory=dict)
    """The rest of the event: the checkpoint, total steps, what was moved to ``superseded/``."""

    def describe(self) -> str:
        first, last = (self.steps[0], self.steps[-1]) if self.steps else (None, None)
        span = "no step recorded" if first is None else f"step {first}" if first == last else f"steps {first}-{last}"
        when = f" on {time.strftime('%Y-%m-%d %H:%M', time.localtime(self.time))}" if self.time else ""
        text = f"{self.event} at step {self.at_step}{when}"
        if self.detail.get("checkpoint"):
            text += f" from checkpoints/{self.detail['checkpoint']}"
        text += f": {span}"
        moved = dict(self.detail.get("superseded") or {})
        if moved:
            where = moved.pop("folder", "superseded/")
            counts = ", ".join(f"{k} {v}" for k, v in moved.items())
            text += f"; what was recorded after step {self.at_step} was moved to {where} ({counts})"
        return text


def run_segments(folder: str | Path, steps: list[int]) -> list[Segment]:
    """The segments of the run in ``folder`` whose metrics.jsonl has ``steps``, in order."""
    events = read_jsonl(Path(folder) / "events.jsonl")
    starts = [e for e in events if e.get("event") in ("started", "resumed") and isinstance(e.get("at_step"), int)]
    if not starts:
        return [Segment("started", 0, tuple(sorted(steps)))] if steps else []
    out = []
    for i, event in enumerate(starts):
        low = event["at_step"]
        high = starts[i + 1]["at_step"] if i + 1 < len(starts) else None
        mine = tuple(s for s in sorted(steps) if s > low and (high is None or s <= high))
        detail = {k: v for k, v in event.items() if k not in ("event", "at_step", "time")}
        out.append(Segment(event["event"], low, mine, event.get("time"), detail))
    return out


def restarts(folder: str | Path) -> list[str]:
    """The earlier runs a ``--restart`` moved aside, in words (``previous-<time>/``: its last step)."""
    out = []
    for event in read_jsonl(Path(folder) / "events.jsonl"):
        if event.get("event") == "restarted":
            last = event.get("previous_last_step", "?")
            out.append(f"{event.get('moved_to', 'previous-*')}/ (an earlier run of this folder, to step {last})")
    return out


def summary_lines(folder: str | Path, steps: list[int]) -> list[str]:
    """One line per segment, then one per earlier run moved aside."""
    segments = run_segments(folder, steps)
    lines = [f"segment {i + 1} of {len(segments)}: {s.describe()}" for i, s in enumerate(segments)]
    return lines + [f"moved aside by --restart: {r}" for r in restarts(folder)]


def segment_of(segments: list[Segment], step: int) -> int | None:
    """The index of the segment that recorded ``step``, or None."""
    return next((i for i, s in enumerate(segments) if step in s.steps), None)
