"""Preference pairs: what a reward model trains on (``train.algorithm: reward_model``).

What this module owns: ``PreferencePair`` (a prompt, the preferred response and the other one, and
where the pair came from), ``read_pairs`` (a JSONL file of ``{"prompt", "chosen", "rejected"}``
rows, read with the project's JSONL reader ``noria.data.source.jsonl_rows``) and ``task_pairs``
(pairs made from a built-in task's prompts, without a file).

A file row::

    {"prompt": "What is 2 + 3?", "chosen": "2 + 3 = 5", "rejected": "2 + 3 = 6"}
    {"prompt": [{"role": "system", ...}, {"role": "user", ...}], "chosen": ..., "rejected": ...}

``prompt`` is a string or a list of chat messages (checked as a prompt row is, by
``noria.data.source.row_to_prompt``); ``chosen`` and ``rejected`` are strings, or TRL's
conversational form, a list holding one assistant message. A bad row raises ``DataError`` naming
the file, the line and the field: not JSON, a field missing or of the wrong type, an empty response,
``chosen`` equal to ``rejected`` (a pair that teaches nothing).

Task pairs (``task_pairs``): for every prompt of a split of a task whose labels are integers (the
arithmetic task), the chosen response gives the label in the form the prompt asks for
(``\\boxed{N}``) and the rejected one is the same text with a wrong number (N plus an offset in
[-10, 10], never 0), in one of a few answer styles; the style and the offset are drawn from a
generator seeded by the task's own seed and the split, so a split always gives the same pairs.

Pairs from a run (``rollout_pairs``; ``data.path`` naming an RL run's folder): on-policy pairs, made
from the trajectories the run recorded (``RUN/rollouts/step-*.jsonl``, as ``noria inspect`` reads
them). Within each group, a sample with a higher reward is preferred to one with a lower reward of
the same group (failed samples, without a reward, are left out); at most ``per_group`` pairs a
group, the best against the worst first; a pair whose two texts are equal is left out. Prompts are
split by a hash of their text: one in ten is held out (``part="test"``), so no prompt is trained on
and evaluated. These are the pairs a reward model meets in an RL run of that policy: the policy's
own right and wrong answers, not a right answer and a number made up.

Not guaranteed: that a file's pairs are consistent (the same pair preferred both ways is accepted);
rows are read whole into memory.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noria.data.source import BadRow, DataError, FieldMap, jsonl_rows, row_to_prompt
from noria.types import Prompt

ANSWER_STYLES = (
    "{expression} = {n}. The answer is \\boxed{{{n}}}.",
    "The answer is \\boxed{{{n}}}.",
    "{expression} = {n}\n\n\\boxed{{{n}}}",
    "\\boxed{{{n}}}",
)
"""How a task pair's responses are written; ``{expression}`` only where the prompt's metadata has one."""
MAX_OFFSET = 10
"""A task pair's wrong number is the right one plus an offset in [-MAX_OFFSET, MAX_OFFSET], never 0."""
PROMPT_ONLY = FieldMap(prompt_key="prompt", label_key=None, metadata_keys=(), images_key=None)


@dataclass(frozen=True)
class PreferencePair:
    """One comparison: ``chosen`` is preferred to ``rejected`` as the answer to ``prompt``."""

    prompt: str | tuple[dict[str, str], ...]
    """A text prompt, or chat messages (the reward model reads them through its chat template)."""
    chosen: str
    rejected: str
    where: str
    """Where the pair came from, for errors: ``file:line``, or ``task:NAME/split #i``."""


def read_pairs(path: str | Path, part: str = "train") -> list[PreferencePair]:
    """Every pair of a JSONL file, in file order; ``DataError`` names the file, line and field of the
    first bad row. A folder is an RL run's: its recorded rollouts' pairs (``rollout_pairs``, ``part``)."""
    if Path(path).is_dir():
        return rollout_pairs(path, part)
    if not Path(path).is_file():
        raise DataError(f"{path}: file not found")
    pairs = []
    for line, row in jsonl_rows(path):
        where = f"{path}:{line.removeprefix('line ')}"
        if isinstance(row, BadRow):
            raise DataError(f"{where}: {row.reason}")
        try:
            pairs.append(pair_of(row, where, len(pairs), str(path)))
        except DataError as e:
            raise DataError(f"{where}: {e}") from e
    if not pairs:
        raise DataError(f"{path}: no preference pairs")
    return pairs


def pair_of(row: Any, where: str, index: int, source: str) -> PreferencePair:
    """A validated pair from one parsed row; ``DataError`` names the field."""
    if not isinstance(row, dict):
        raise DataError(f"expected an object with prompt, chosen and rejected, got {type(row).__name__}")
    prompt = row_to_prompt(row, PROMPT_ONLY, index, source).prompt
    chosen, rejected = response_of(row, "chosen"), response_of(row, "rejected")
    if chosen == rejected:
        raise DataError("field 'rejected' is the same text as 'chosen': a pair must hold two different responses")
    return PreferencePair(prompt, chosen, rejected, where)


def response_of(row: dict[str, Any], key: str) -> str:
    """The response text of field ``key``: a string, or a list of one assistant message."""
    if key not in row:
        raise DataError(f"field '{key}' is missing (row has: {', '.join(sorted(map(str, row))) or 'nothing'})")
    value = row[key]
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict) and value[0].get("role") == "assistant":
        value = value[0].get("content")
    if not isinstance(value, str):
        raise DataError(f"field '{key}': expected a string (or a list of one assistant message), got {type(row[key]).__name__}")
    if not value.strip():
        raise DataError(f"field '{key}': the response is empty")
    return value


def rollout_pairs(run_dir: str | Path, part: str = "train", per_group: int = 4) -> list[PreferencePair]:
    """On-policy pairs from a run's recorded rollouts (module docstring); ``part``: train or test
    (one prompt in ten, by a hash of its text). ``DataError`` names the run, file and line of a bad row."""
    if part not in ("train", "test"):
        raise ValueError(f"rollout_pairs: part must be train or test, got {part!r}")
    files = sorted((Path(run_dir) / "rollouts").glob("step-*.jsonl"))
    if not files:
        raise DataError(f"{run_dir}: a folder of preference pairs must be an RL run's, with rollouts/step-*.jsonl; found none")
    groups: dict[tuple[int, int], list[tuple[dict[str, Any], str]]] = {}
    for path in files:
        for line, row in jsonl_rows(path):
            where = f"{path}:{line.removeprefix('line ')}"
            if isinstance(row, BadRow):
                raise DataError(f"{where}: {row.reason}")
            missing = [k for k in ("step", "group_id", "prompt", "response", "reward") if not isinstance(row, dict) or k not in row]
            if missing:
                raise DataError(f"{where}: not a recorded trajectory: field(s) {', '.join(missing)} missing")
            if row["reward"] is not None and _held_out(row["prompt"]) == (part == "test"):
                groups.setdefault((row["step"], row["group_id"]), []).append((row, where))
    pairs: list[PreferencePair] = []
    for members in groups.values():
        ranked = sorted(members, key=lambda m: -float(m[0]["reward"]))
        made = 0
        for best, worst in _best_against_worst(ranked):
            if made == per_group:
                break
            (a, where), (b, _) = best, worst
            if float(a["reward"]) > float(b["reward"]) and a["response"] != b["response"]:
                prompt = a["prompt"] if isinstance(a["prompt"], str) else tuple(a["prompt"])
                pairs.append(PreferencePair(prompt, a["response"], b["response"], where))
                made += 1
    if not pairs:
        raise DataError(f"{run_dir}: no {part} pairs: no recorded group held two samples with different rewards")
    return pairs


def _best_against_worst(ranked: list) -> Any:
    """(i-th best, j-th worst) of a group ranked best first, the best against the worst first."""
    for shift in range(len(ranked)):
        for i in range(len(ranked)):
            j = len(ranked) - 1 - ((i + shift) % len(ranked))
            if i < j:
                yield ranked[i], ranked[j]


def _held_out(prompt: Any) -> bool:
    """One prompt in ten is held out, by a stable hash of its text."""
    return hashlib.sha256(repr(prompt).encode()).digest()[0] % 10 == 0


def task_pairs(prompts: Sequence[Prompt], task: str, split: str, seed: int) -> list[PreferencePair]:
    """Pairs made from a task split's prompts (see the module docstring); ``DataError`` naming
    ``data.task`` when the task's prompts are not text with an integer label."""
    rng = random.Random(f"noria-pairs:{task}:{split}:{seed}")
    pairs = []
    for i, p in enumerate(prompts):
        where = f"task:{task}/{split} #{i}"
        right = _integer(p.label)
        if right is None or not isinstance(p.prompt, str):
            raise DataError(
                f"data.task {task}: pairs are made from text prompts with an integer label (the arithmetic task); "
                f"{where} has label {p.label!r}"
            )
        expression = p.metadata.get("expression")
        styles = ANSWER_STYLES if expression else [s for s in ANSWER_STYLES if "{expression}" not in s]
        style = rng.choice(styles)
        offset = rng.choice([d for d in range(-MAX_OFFSET, MAX_OFFSET + 1) if d != 0])
        chosen = style.format(expression=expression, n=right)
        rejected = style.format(expression=expression, n=right + offset)
        pairs.append(PreferencePair(p.prompt, chosen, rejected, where))
    return pairs


def _integer(label: Any) -> int | None:
    try:
        return int(str(label).strip())
    except ValueError:
        return None
