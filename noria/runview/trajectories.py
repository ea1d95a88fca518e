"""``noria inspect RUN_DIR --step N``: a step's sampled trajectories, per token, readable in a terminal.

Reads ``RUN_DIR/rollouts/step-NNNNNN.jsonl`` (written by ``RunLog.write_samples`` at the end of every
RL step) and prints, per group, the prompt, the prompt as the model saw it (after the chat template)
and the label, then per sample its reward, the advantage it was trained with, status (and
reason), length, mean logprob and response; then, unless ``--no-tokens``, one line per response
token: position, the token's text, loss mask (1 = sampled by the policy, trained on), the rollout
logprob with the token's probability as a bar, and the weight version that produced it.

Below the step's header, the run's segments (``noria.runview.segments``): each start of ``noria
train`` on the folder (started, resumed from a checkpoint) with the steps it recorded, the one this
step belongs to marked, and the earlier runs a ``--restart`` moved aside.

Colour is used only on a terminal (tokens outside the loss mask are dimmed); piped output is plain
text. Nothing here changes the run folder.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

from noria.errors import NoriaError
from noria.metrics import read_jsonl
from noria.runview.segments import run_segments, segment_of, summary_lines

BAR = 10  # characters of the probability bar


def step_file(folder: Path, step: int | None) -> Path:
    """The rollouts file of ``step`` (the last one written when None); errors list what exists."""
    files = sorted((folder / "rollouts").glob("step-*.jsonl"))
    if not files:
        raise NoriaError(f"{folder}: no rollouts/step-*.jsonl (a run of noria train with train.algorithm rl writes them)")
    if step is None:
        return files[-1]
    path = folder / "rollouts" / f"step-{step:06d}.jsonl"
    if not path.is_file():
        have = [int(f.stem.split("-")[1]) for f in files]
        raise NoriaError(f"{folder}: no rollouts for step {step}; steps with rollouts: {_ranges(have)}")
    return path


def _ranges(steps: list[int]) -> str:
    out, start = [], None
    for i, s in enumerate(steps):
        if start is None:
            start = s
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            out.append(str(start) if start == s else f"{start}-{s}")
            start = None
    return ", ".join(out)


def load_step(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def inspect_step(folder: str | Path, step: int | None = None, group: int | None = None, limit: int = 8,
                 tokens: bool = True, out: TextIO | None = None, color: bool | None = None) -> int:  # fmt: skip
    """Print the trajectories of ``step`` (filtered by ``group``; at most ``limit`` samples, 0 = all)."""
    out = out or sys.stdout
    color = out.isatty() if color is None else color
    path = step_file(Path(folder), step)
    records = load_step(path)
    if group is not None:
        records = [r for r in records if r["group_id"] == group]
        if not records:
            raise NoriaError(f"{path}: no samples of group {group}")
    shown = records if limit <= 0 else records[:limit]
    style = Style(color)
    out.write(header(path, records, len(shown)) + "\n")
    out.write(segments_block(Path(folder), records[0]["step"] if records else None))
    last_group = None
    for rec in shown:
        if rec["group_id"] != last_group:
            last_group = rec["group_id"]
            out.write("\n" + style.bold(f"== group {rec['group_id']}  label {rec.get('label')!r}") + "\n")
            out.write(f"   prompt ({rec.get('prompt_tokens', '?')} tokens): {prompt_text(rec['prompt'])}\n")
            if rec.get("prompt_text"):  # what the model saw: the prompt after the chat template
                out.write(f"   templated: {rec['prompt_text']!r}\n")
        out.write(sample_block(rec, style, tokens))
    if len(shown) < len(records):
        out.write(f"\n({len(records) - len(shown)} more samples: --limit 0 shows all, --group G one group)\n")
    return len(shown)


def header(path: Path, records: list[dict[str, Any]], shown: int) -> str:
    rewards = [r["reward"] for r in records if r.get("reward") is not None]
    statuses: dict[str, int] = {}
    for r in records:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    groups = len({r["group_id"] for r in records})
    mean_reward = f"{sum(rewards) / len(rewards):.3f}" if rewards else "n/a"
    status_text = ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))
    step = records[0]["step"] if records else "?"
    return (f"step {step}: {len(records)} samples in {groups} groups ({path}); reward mean {mean_reward}; "
            f"{status_text}; showing {shown}")  # fmt: skip


def segments_block(folder: Path, step: int | None) -> str:
    """``run: N steps in K segments`` and one line per segment (``<-`` marks the one of ``step``),
    then the earlier runs moved aside; nothing for a run of one segment, never resumed or restarted."""
    steps = sorted({r["step"] for r in read_jsonl(folder / "metrics.jsonl") if isinstance(r.get("step"), int)})
    lines = summary_lines(folder, steps)
    if len(lines) <= 1:
        return ""
    mine = segment_of(run_segments(folder, steps), step) if step is not None else None
    marked = [f"  {line}{'  <- this step' if i == mine else ''}" for i, line in enumerate(lines)]
    return f"run: {len(steps)} steps in {len(run_segments(folder, steps))} segments\n" + "\n".join(marked) + "\n"


def prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return repr(prompt)
    return " | ".join(f"{m.get('role')}: {m.get('content')!r}" for m in prompt)


def sample_block(rec: dict[str, Any], style: Style, tokens: bool) -> str:
    lps = [lp for lp, m in zip(rec["logprobs"], rec["loss_mask"]) if m and lp is not None]
    mean_lp = f"{sum(lps) / len(lps):.3f}" if lps else "n/a"
    reward = "none" if rec.get("reward") is None else f"{rec['reward']:.3f}"
    advantage = "n/a" if rec.get("advantage") is None else f"{rec['advantage']:+.3f}"
    status = rec["status"] + (f" ({rec['status_reason']})" if rec.get("status_reason") else "")
    versions = sorted({v for v in rec.get("weight_versions") or [] if v >= 0})
    lines = [
        f"\n  sample {rec['index']}: reward {style.bold(reward)}  advantage {advantage}  status {status}  "
        f"{len(rec['token_ids'])} tokens ({sum(rec['loss_mask'])} trained)  mean logprob {mean_lp}  "
        f"versions {versions}",
        f"  response: {rec['response']!r}",
    ]
    if tokens:
        lines.append(style.dim("     #  token                 mask  logprob   prob" + " " * (BAR - 3) + " version"))
        lines.extend(token_lines(rec, style))
    return "\n".join(lines) + "\n"


def token_lines(rec: dict[str, Any], style: Style) -> Iterable[str]:
    pieces = rec.get("tokens") or [f"<{t}>" for t in rec["token_ids"]]
    versions = rec.get("weight_versions") or [None] * len(pieces)
    for i, (piece, mask, lp, ver) in enumerate(zip(pieces, rec["loss_mask"], rec["logprobs"], versions)):
        text = json.dumps(piece, ensure_ascii=False)[:20]
        if lp is None:
            lp_text, bar = "     n/a", " " * BAR
        else:
            p = math.exp(lp)
            filled = round(p * BAR)
            lp_text, bar = f"{lp:8.4f}", "#" * filled + "." * (BAR - filled)
        line = f"  {i:>4}  {text:<20}  {mask:>4}  {lp_text}  {bar}  {'' if ver is None else ver}"
        yield line if mask else style.dim(line)


class Style:
    """ANSI bold / dim on a terminal, plain text otherwise."""

    def __init__(self, color: bool) -> None:
        self.color = color

    def bold(self, text: str) -> str:
        return f"\033[1m{text}\033[0m" if self.color else text

    def dim(self, text: str) -> str:
        return f"\033[2m{text}\033[0m" if self.color else text
