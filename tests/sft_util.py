"""Helpers of the SFT run tests (tests/launch/): a small chat file and the overrides of a tiny SFT run."""

from __future__ import annotations

import json
from pathlib import Path

CHATS = [
    [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": f"The answer is {a + b}."}]
    + ([{"role": "user", "content": f"Compute {a} * {b}."}, {"role": "assistant", "content": f"{a} * {b} = {a * b}."}] if a % 2 else [])
    for a, b in [(3, 4), (5, 6), (7, 1), (2, 9), (8, 8), (1, 1), (9, 3), (4, 7), (6, 2), (5, 5)]
]


def write_chats(path: Path, rows=CHATS) -> Path:
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    return path


def args_for(model_dir, data: Path, **overrides) -> list[str]:
    """CLI overrides of a small SFT run: 10 rows, 4 per step, 2 epochs -> 5 steps."""
    fields = {"model.path": model_dir, "data.path": data, "train.algorithm": "sft", "train.param_dtype": "bfloat16",
              "train.global_batch": 4, "train.micro_batch_tokens": 64, "train.save_every": 2, "data.epochs": 2,
              "train.optim.lr": 0.01, "train.logprob_chunk_tokens": 16}
    fields.update(overrides)
    return [a for k, v in fields.items() for a in (f"--{k}", str(v))]


def losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows]
