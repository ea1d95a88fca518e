"""The run log of ``noria train`` (RL): metrics.jsonl, eval.jsonl, evaluation samples, progress.

Files in the run folder::

    metrics.jsonl          one JSON object per rollout step (names below)
    eval.jsonl             one per evaluation: step, version, accuracy, n_prompts, n_answers, seconds
                           (or ``skipped`` with the reason when it failed)
    eval/step-000010.jsonl the evaluation's answers (prompt ids left out): reward, status, text

Metric names (units in brackets): ``step``, ``version`` (weight version the engines serve after the
step), ``seconds`` (wall time of the step), ``time/{rollout,reward,train,sync}_s`` [s],
``rollout/reward_mean``, ``rollout/response_len_mean`` [tokens], ``rollout/truncated_frac``,
``rollout/tokens_per_s`` [tokens/s of generation], ``rollout/groups_zero_variance_frac``,
``reward/failed``, ``buffer/*``, the trainer's (``loss``, ``grad_norm``, ``lr``, ``clip_frac``,
``approx_kl``, ``entropy``, ``rollout_logprob_abs_diff`` and ``_max``, ``rollout_kl``, ...), and
``sync/*`` from the weight sync.

Progress: a tqdm bar on a terminal, else one plain line per step (CI logs stay readable).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def mean(values: Iterable[float]) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else math.nan


class RunLog:
    """Writes the run's metric files and shows progress; see the module docstring."""

    def __init__(self, folder: Path, total_steps: int, start_step: int, progress: bool | None) -> None:
        self.folder = folder
        self.total = total_steps
        self.start_step = start_step
        self.started = time.perf_counter()
        self.metrics = (folder / "metrics.jsonl").open("a")
        self.evals = (folder / "eval.jsonl").open("a")
        self.last_accuracy: float | None = None
        tty = sys.stderr.isatty() if progress is None else progress
        self.bar = None
        if tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", file=sys.stderr)

    def write_step(self, row: dict[str, Any]) -> None:
        self.metrics.write(json.dumps(clean(row)) + "\n")
        self.metrics.flush()
        if self.bar is not None:
            self.bar.set_postfix_str(short(row, self.last_accuracy))
            self.bar.update(1)
        else:
            eta = self.eta(row["step"])
            print(f"step {row['step']}/{self.total} {short(row, self.last_accuracy)} eta {eta}", file=sys.stderr, flush=True)

    def write_eval(self, row: dict[str, Any], samples: list[Any] | None = None) -> None:
        self.evals.write(json.dumps(clean(row)) + "\n")
        self.evals.flush()
        if "accuracy" in row:
            self.last_accuracy = row["accuracy"]
            message = (
                f"eval at step {row['step']}: accuracy {row['accuracy']:.1%} on {row['n_prompts']} prompts "
                f"({row['seconds']:.0f} s)"
            )
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
        for f in (self.metrics, self.evals):
            if not f.closed:
                f.close()


def short(row: dict[str, Any], accuracy: float | None) -> str:
    """The few numbers shown per step."""
    parts = [f"reward {row.get('rollout/reward_mean', math.nan):.3f}"]
    if accuracy is not None:
        parts.append(f"acc {accuracy:.1%}")
    for key, label, fmt in (
        ("loss", "loss", "{:.4f}"),
        ("rollout_logprob_abs_diff_max", "|dlp|max", "{:.2g}"),
        ("rollout/tokens_per_s", "gen tok/s", "{:.0f}"),
        ("time/rollout_s", "rollout", "{:.1f}s"),
        ("time/train_s", "train", "{:.1f}s"),
        ("sync/seconds", "sync", "{:.2f}s"),
    ):
        if key in row:
            parts.append(f"{label} {fmt.format(row[key])}")
    return " ".join(parts)


def sample_record(step: int, group: Any, s: Any, tokenizer: Any = None) -> dict[str, Any]:
    """One line of rollouts/step-N.jsonl: the trajectory with its per-token loss mask and logprobs."""
    prompt = group.prompt.prompt
    pieces = tokenizer.batch_decode([[t] for t in s.response_ids]) if tokenizer is not None else None
    return clean({
        "step": step, "group_id": s.group_id, "index": s.index,
        "prompt": prompt if isinstance(prompt, str) else list(prompt), "label": _jsonable(group.prompt.label),
        "reward": s.reward, "status": s.status.value, "status_reason": s.status_reason,
        "response": s.response_text, "prompt_tokens": len(s.prompt_ids),
        "token_ids": list(s.response_ids), "tokens": pieces, "loss_mask": list(s.loss_mask),
        "logprobs": [None if not math.isfinite(x) else x for x in s.rollout_logprobs],
        "weight_versions": list(s.weight_versions),
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
