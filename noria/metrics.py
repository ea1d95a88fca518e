"""The run log of ``noria train`` (RL): metric files, metric sinks, sampled trajectories, progress.

Files in the run folder::

    metrics.jsonl            one JSON object per rollout step (every name is in ``noria.metric_names.METRICS``)
    events.jsonl             one per start of ``noria train`` on this folder (``record_event``):
                             ``started``, ``resumed`` or ``restarted``, with ``at_step``, ``time`` and
                             what the start did (``noria report`` and ``noria inspect`` show the segments)
    eval.jsonl               one per evaluation: step, version, accuracy, n_prompts, n_answers, seconds
                             (or ``skipped`` with the reason when it failed)
    eval/step-000010.jsonl   the evaluation's answers (prompt ids left out): reward, status, text
    rollouts/step-000003.jsonl  every sampled trajectory of a step: prompt, response, reward, status,
                             per-token ids, text pieces, loss mask, logprobs, weight versions
                             (``noria inspect RUN_DIR --step 3`` prints it)
    tensorboard/             event files, when ``log.loggers`` names ``tensorboard``
    wandb/                   the W&B run, when ``log.loggers`` names ``wandb`` (offline by default: no network;
                             ``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later)

JSONL is always written; the other sinks receive the same rows (evaluations as ``eval/accuracy``
and friends). ``noria.metric_names.METRICS`` is the one table of metric names, units and meanings: the docs
(``docs/metrics.md``) are generated from it, and a test fails when the loop logs a name it lacks.

Progress: a tqdm bar on a terminal, else one plain line per step (CI logs stay readable); both show
reward, held-out accuracy, tokens/s, stage times, staleness and buffer size when asynchronous, ETA.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from noria import faults
from noria.errors import DiskError
from noria.types import Group, Status

SINKS = ("jsonl", "tensorboard", "wandb")


def mean(values: Iterable[float]) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else math.nan


def group_metrics(groups: list[Group]) -> dict[str, float]:
    """What the trained groups hold: rewards, lengths, statuses, weight versions."""
    samples = [s for g in groups for s in g.samples]
    rewards = [s.reward for s in samples if s.reward is not None]
    lengths = [len(s.response_ids) for s in samples]
    solved = [g for g in groups if any((s.reward or 0) > 0 for s in g.samples)]
    uniform = [g for g in groups if len({s.reward for s in g.samples}) == 1]
    mixed = [g for g in groups if len({v for s in g.samples for v, m in zip(s.weight_versions, s.loss_mask) if m}) > 1]
    return {
        "rollout/reward_mean": mean(rewards),
        "rollout/response_len_mean": mean(lengths),
        "rollout/trained_tokens": float(sum(lengths)),
        "rollout/truncated_frac": mean([s.status is Status.TRUNCATED for s in samples]),
        "rollout/aborted": float(sum(s.status is Status.ABORTED for s in samples)),
        "rollout/groups_solved_frac": len(solved) / max(len(groups), 1),
        "rollout/groups_zero_variance_frac": len(uniform) / max(len(groups), 1),
        "rollout/groups_mixed_versions_frac": len(mixed) / max(len(groups), 1),
    }


# ---------------------------------------------------------------------------------------- sinks


class TensorBoardSink:
    """Scalars into ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR/tensorboard``)."""

    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder / "tensorboard"))

    def log(self, row: dict[str, Any], step: int) -> None:
        for key, value in numbers(row).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run in ``RUN_DIR/wandb``; ``mode: offline`` needs no network or account."""

    def __init__(self, folder: Path, config: Any) -> None:
        import os

        import wandb

        from noria.config import to_dict

        os.environ.setdefault("WANDB_SILENT", "true")
        log = config.log
        self.run = wandb.init(
            project=log.wandb_project, name=folder.name, dir=str(folder), mode=log.wandb_mode,
            config=to_dict(config), reinit="finish_previous", settings=wandb.Settings(console="off"),
        )  # fmt: skip

    def log(self, row: dict[str, Any], step: int) -> None:
        self.run.log(numbers(row), step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        # W&B reads its WANDB_* variables once per process (the wandb.setup singleton): torn down
        # here, the next run of this process (the Python API runs several) reads them again.
        wandb.teardown()


def build_sinks(folder: Path, config: Any) -> list[Any]:
    """The extra sinks ``config.log.loggers`` names (JSONL is RunLog's own and always on)."""
    names = config.log.loggers if config is not None else ["jsonl"]
    sinks: list[Any] = []
    if "tensorboard" in names:
        sinks.append(TensorBoardSink(folder))
    if "wandb" in names:
        sinks.append(WandbSink(folder, config))
    return sinks


def numbers(row: dict[str, Any]) -> dict[str, float]:
    """The finite numeric values of ``row`` (what TensorBoard and W&B take)."""
    out = {}
    for k, v in row.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "step":
            out[k] = float(v)
    return out


# ---------------------------------------------------------------------------------------- run log


BAR_FORMAT = "{desc} {n}/{total} {bar:8} {elapsed}<{remaining} {postfix}"
"""The training bar: a short bar, so a narrow terminal keeps room for the step's figures."""
BAR_COLUMNS = 40
"""Columns the bar's own part takes (description, counts, bar, times) at most."""


def record_event(folder: Path, event: str, at_step: int, **detail: Any) -> None:
    """One line of ``RUN_DIR/events.jsonl``: a start of ``noria train`` on the folder (``started``,
    ``resumed``, ``restarted``) at ``at_step``, with what it did (``detail``: JSON-able)."""
    with (Path(folder) / "events.jsonl").open("a") as events:
        events.write(json.dumps({"event": event, "at_step": at_step, "time": time.time(), **detail}) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The whole JSON lines of one of the run's JSONL files ([] if missing); a line cut short (a live
    run's last one, or a crash's) is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class RunLog:
    """Writes the run's metric files, feeds the sinks and shows progress; see the module docstring."""

    def __init__(
        self, folder: Path, total_steps: int, start_step: int, progress: bool | None, config: Any = None, event: dict | None = None
    ) -> None:
        self.folder = folder
        self.total = total_steps
        self.start_step = start_step
        self.started = time.perf_counter()
        self.metrics = (folder / "metrics.jsonl").open("a")
        self.evals = (folder / "eval.jsonl").open("a")
        self.last_eval: tuple[float, int] | None = None
        """(accuracy, step) of the newest evaluation: the step line shows it as ``eval 26.0% @0``
        (a resumed run starts from the newest one the folder recorded)."""
        done = [r for r in read_jsonl(folder / "eval.jsonl") if "accuracy" in r and r.get("step", 0) <= start_step] if start_step else []
        if done:
            self.last_eval = (done[-1]["accuracy"], done[-1]["step"])
        self.show_buffer = config is not None and getattr(config.rollout, "max_staleness", 0) > 0
        self.sinks = build_sinks(folder, config)
        tty = sys.stderr.isatty() if progress is None else progress
        self.bar = None
        if tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", file=sys.stderr,
                            bar_format=BAR_FORMAT, dynamic_ncols=True)  # fmt: skip
        self.last_row: dict[str, Any] | None = None
        # metrics.jsonl keeps one row per step (what pandas and plots read); run starts go beside it.
        record_event(folder, "resumed" if start_step > 0 else "started", start_step, **(event or {}))

    def write_step(self, row: dict[str, Any]) -> None:
        self.append(self.metrics, row)
        for sink in self.sinks:
            sink.log(row, row["step"])
        self.last_row = row
        if self.bar is not None:
            self.bar.set_postfix_str(short(row, self.last_eval, self.show_buffer, self.postfix_width()), refresh=False)
            self.bar.update(1)
        else:
            text = short(row, self.last_eval, self.show_buffer)
            print(f"step {row['step']}/{self.total} {text} eta {self.eta(row['step'])}", file=sys.stderr, flush=True)

    def postfix_width(self) -> int:
        """Columns left for the step's figures on this terminal after the bar's own part."""
        import shutil

        return max(shutil.get_terminal_size((100, 24)).columns - BAR_COLUMNS, 24)

    def append(self, file: Any, row: dict[str, Any]) -> None:
        """One JSON line, flushed; a failed write (disk full, read-only) stops the run naming the file
        and the space left (``DiskError``). A line cut short is dropped when the run resumes."""
        try:
            faults.point("metrics.write")
            file.write(json.dumps(clean(row)) + "\n")
            file.flush()
        except OSError as e:
            raise DiskError.writing(file.name, e, f"the run log (step {row.get('step')})") from e

    def write_eval(self, row: dict[str, Any], samples: list[Any] | None = None) -> None:
        self.append(self.evals, row)
        if "accuracy" in row:
            self.last_eval = (row["accuracy"], row["step"])
            if self.bar is not None and self.last_row is not None:  # the bar shows the newest accuracy
                self.bar.set_postfix_str(short(self.last_row, self.last_eval, self.show_buffer, self.postfix_width()))
            numbers = {f"eval/{k}": float(v) for k, v in row.items() if k not in ("step", "version") and isinstance(v, (int, float))}
            for sink in self.sinks:  # the measured step (fleet and checkpoint rows arrive later than it)
                sink.log(numbers, row["step"])
            message = (
                f"eval at step {row['step']}: accuracy {row['accuracy']:.1%} on {row['n_prompts']} prompts "
                f"({row['seconds']:.0f} s{lag_note(row)})"
            )
            if row.get("valid") is False:
                message += f" INVALID: {row['invalid_reason']}"
        else:
            message = f"eval at step {row['step']} skipped: {row['skipped']}"
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)
        if samples:
            out = self.folder / "eval" / f"step-{row['step']:06d}.jsonl"
            out.parent.mkdir(parents=True, exist_ok=True)
            with out.open("w") as f:
                for s in samples:
                    f.write(json.dumps({"group_id": s.group_id, "index": s.index, "reward": s.reward,
                                        "status": s.status.value, "response": s.response_text}) + "\n")  # fmt: skip

    def write_samples(self, step: int, groups: list[Any], tokenizer: Any = None) -> Path:
        """``rollouts/step-NNNNNN.jsonl``: every sampled trajectory of ``step`` (what ``noria inspect`` reads)."""
        out = self.folder / "rollouts" / f"step-{step:06d}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w") as f:
            for group in groups:
                for s in group.samples:
                    f.write(json.dumps(sample_record(step, group, s, tokenizer)) + "\n")
        return out

    def eta(self, step: int) -> str:
        done = step - self.start_step
        if done <= 0:
            return "?"
        left = (time.perf_counter() - self.started) / done * (self.total - step)
        return f"{int(left // 60)}m{int(left % 60):02d}s"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        for f in (self.metrics, self.evals):
            if not f.closed:
                f.close()


def short(row: dict[str, Any], last_eval: tuple[float, int] | None, show_buffer: bool = False, width: int | None = None) -> str:
    """The few numbers shown per step: reward, the last evaluation, loss, throughput, stage times, agreement.

    The held-out accuracy is the newest evaluation's, with the step it measured (``eval 26.0% @0``):
    it changes only when an evaluation lands, never reads as a live figure. With ``width``, fields are
    dropped least important first (:data:`SHORT_FIELDS` order, from the end) until the line fits;
    reward and the evaluation always stay."""
    fields = short_fields(row, last_eval, show_buffer)
    if width is not None:
        while len(fields) > 2 and len(" ".join(text for _, text in fields)) > width:
            fields.remove(max(fields, key=lambda f: f[0]))
    return " ".join(text for _, text in fields)


SHORT_FIELDS = (
    ("loss", "loss", "{:.4f}"),
    ("rollout/tokens_per_s", "gen tok/s", "{:.0f}"),
    ("time/trainer_wait_s", "wait", "{:.1f}s"),
    ("time/train_s", "train", "{:.1f}s"),
    ("train_tokens_per_s", "train tok/s", "{:.0f}"),
    ("rollout_logprob_abs_diff_max", "|dlp|max", "{:.2g}"),
    ("sync/seconds", "sync", "{:.2f}s"),
)
"""The per-step fields after reward, accuracy and staleness, most important first (a narrow
terminal drops them from the end)."""


def short_fields(row: dict[str, Any], last_eval: tuple[float, int] | None, show_buffer: bool) -> list[tuple[int, str]]:
    """(rank, text) of each field shown, in display order; a lower rank is more important."""
    parts = [(0, f"reward {row.get('rollout/reward_mean', math.nan):.3f}")]
    if last_eval is not None:
        accuracy, step = last_eval
        parts.append((1, f"eval {accuracy:.1%} @{step}"))
    if show_buffer or row.get("buffer/staleness_max", 0) or row.get("buffer/size", 0):
        parts.append((3, f"stale {row.get('buffer/staleness_mean', 0):.1f}/{row.get('buffer/staleness_max', 0):.0f}"))
        parts.append((6, f"buf {row.get('buffer/size', 0):.0f}"))
    if row.get("time/train_s") and "tokens" in row:
        row = {**row, "train_tokens_per_s": row["tokens"] / row["time/train_s"]}
    display = ("loss", "rollout_logprob_abs_diff_max", "rollout/tokens_per_s", "train_tokens_per_s",
               "time/trainer_wait_s", "time/train_s", "sync/seconds")  # fmt: skip
    ranks = {key: 2 + i * 2 for i, (key, _, _) in enumerate(SHORT_FIELDS)}
    formats = {key: (label, fmt) for key, label, fmt in SHORT_FIELDS}
    for key in display:
        if key in row and row[key] is not None:
            label, fmt = formats[key]
            parts.append((ranks[key], f"{label} {fmt.format(row[key])}"))
    return parts


class Progress:
    """Progress of a counted job (``noria eval``): tqdm on a terminal, else a plain line every ~10%.

    ``enabled=False`` shows nothing; ``None`` picks by whether stderr is a terminal.
    """

    def __init__(self, total: int, desc: str, unit: str, enabled: bool | None = True) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.done = 0
        self.started = time.perf_counter()
        self.next_line = max(total // 10, 1)
        self.enabled = enabled is not False
        self.bar = None
        if self.enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and (self.done >= self.next_line or self.done >= self.total):
            self.next_line = self.done + max(self.total // 10, 1)
            elapsed = time.perf_counter() - self.started
            rate = self.done / elapsed if elapsed > 0 else 0.0
            left = (self.total - self.done) / rate if rate > 0 else math.nan
            eta = f"{int(left // 60)}m{int(left % 60):02d}s" if math.isfinite(left) else "?"
            print(f"{self.desc} {self.done}/{self.total} {self.unit}s {rate:.1f} {self.unit}s/s eta {eta}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def sample_record(step: int, group: Any, s: Any, tokenizer: Any = None) -> dict[str, Any]:
    """One line of rollouts/step-N.jsonl: the trajectory with its per-token loss mask and logprobs."""
    prompt = group.prompt.prompt
    pieces = tokenizer.batch_decode([[t] for t in s.response_ids]) if tokenizer is not None else None
    return clean({
        "step": step, "group_id": s.group_id, "index": s.index,
        "prompt": prompt if isinstance(prompt, str) else list(prompt), "label": _jsonable(group.prompt.label),
        "reward": s.reward, "status": s.status.value, "status_reason": s.status_reason,
        "response": s.response_text, "prompt_tokens": len(s.prompt_ids), "advantage": s.advantage,
        "prompt_text": tokenizer.decode(s.prompt_ids) if tokenizer is not None else None,
        "token_ids": list(s.response_ids), "tokens": pieces, "loss_mask": list(s.loss_mask),
        "logprobs": [None if not math.isfinite(x) else x for x in s.rollout_logprobs],
        "weight_versions": list(s.weight_versions),
        **({"images": list(s.images)} if getattr(s, "images", None) else {}),  # by content hash: the run folder's images/
    })  # fmt: skip


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def clean(row: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe values: NaN and infinities become null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def lag_note(row: dict[str, Any]) -> str:
    """``, N steps / S s late`` for an evaluation recorded after later steps (fleet, checkpoint), else ""."""
    n = row.get("lag_steps")
    return f", {n} step{'s' if n != 1 else ''} / {row['lag_s']:.0f} s late" if n else ""
