"""``noria train`` for ``train.algorithm: reward_model``: a scalar reward model trained on preference
pairs (pairwise Bradley-Terry), run by the SFT job's loop (``noria.launch.sft.sft_loop``: run folder,
metrics.jsonl, checkpoints and ``--resume``, FSDP2 ranks, the final export) with the pairs in place
of chat rows.

How data moves::

    data.path: JSONL of {"prompt", "chosen", "rejected"}  (noria.data.pairs.read_pairs)
    or an RL run's folder: its recorded groups, a higher reward preferred (noria.data.pairs.rollout_pairs)
    or data.task: a task's train split -> pairs, the right answer preferred (noria.data.pairs.task_pairs)
      -> each response after the prompt, through the base model's chat template: the token ids the
         scalar reward (noria.rewards.scalar.rm_input_ids) reads in an RL run
      -> PairData: sft_loop asks it for the backend (noria.train.reward_model.RewardModelBackend),
         one step per batch of train.global_batch pairs, and evaluations
    held-out pairs (the task's test split, or data.test_path): pairwise accuracy (share of pairs with
    r(chosen) > r(rejected)) before step 1, every eval.every steps and at the end -> eval.jsonl
    RUN_DIR/final/: an AutoModelForSequenceClassification folder: reward.model.engine of an RL run

Every pair is read, checked and tokenized before any model loads: a bad row, a row longer than
``train.max_seq_tokens`` or one whose last token is the pad id (where transformers would stop
reading it) stops the run naming its file and line (or task split and number) and the field.

Not guaranteed: a run interrupted between a step and its evaluation does not evaluate that step
when resumed (its next evaluation is at the next due step, or at the end).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noria.config import RunConfig
from noria.data.pairs import PreferencePair, read_pairs, task_pairs
from noria.data.source import DataError
from noria.train.reward_model import PairIds, RewardModelBackend, pack_pairs, pair_metrics
from noria.types import Prompt


@dataclass
class PairData:
    """The tokenized pairs of a reward-model run and what ``sft_loop`` asks of its data."""

    pairs: list[PairIds]
    """(chosen ids, rejected ids) of every training pair."""
    records: list[Prompt]
    """One record per training pair (``index``: its position in ``pairs``), for ``PromptSource``."""
    held_out: list[PairIds]
    """The pairs evaluated (empty: no evaluation)."""
    pad_id: int
    every: int
    """eval.every: steps between evaluations (0: none)."""
    eval_pairs: int
    """Pairs scored per batch of an evaluation (eval.batch_size)."""
    first_step: int = 0
    """The step this start of the run began at (set by ``evaluate("start")``)."""

    def make_backend(self, config: RunConfig) -> Any:
        return RewardModelBackend(config.train, model_impl=config.model.impl, seed=config.seed, pad_id=self.pad_id)

    def train_step(self, backend: Any, rows: list[Prompt]) -> dict[str, float]:
        return backend.train_pairs(pack_pairs([self.pairs[r.index] for r in rows]))

    def evaluate(self, backend: Any, folder: Path, when: str) -> None:
        """Pairwise accuracy on the held-out pairs if due at ``when`` (``start``: before step 1;
        ``step``: every ``every`` steps; ``end``: after a last step trained now and not evaluated);
        collective under FSDP2 (every rank scores; the decision depends on nothing but the step, so
        every rank takes it alike), rank 0 writes eval.jsonl and the line."""
        step = backend.optimizer_steps
        if when == "start":
            self.first_step = step
        if not self.held_out or not self.every:
            return
        if when == "start":
            due = step == 0
        elif when == "step":
            due = step % self.every == 0
        else:
            due = step > self.first_step and step % self.every != 0
        if not due:
            return
        import torch

        t0 = time.perf_counter()
        chunks = [self.held_out[i : i + self.eval_pairs] for i in range(0, len(self.held_out), self.eval_pairs)]
        scores = torch.cat([backend.scores(pack_pairs(chunk)) for chunk in chunks])
        if backend.rank != 0:
            return
        row = {"step": step, **pair_metrics(scores), "n_pairs": len(self.held_out), "seconds": round(time.perf_counter() - t0, 3)}
        with (folder / "eval.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"eval at step {step}: pairwise accuracy {row['pair_accuracy']:.1%} on {row['n_pairs']} held-out pairs "
            f"(margin {row['margin']:+.3f}, loss {row['loss']:.4f}, {row['seconds']:.0f} s)",
            file=sys.stderr, flush=True,
        )  # fmt: skip


def prepare_pairs(config: RunConfig) -> PairData:
    """Read, check and tokenize every pair (see the module docstring); no model loads."""
    from noria.data.loader import load_prompts
    from noria.models import load_tokenizer
    from noria.models.catalog import model_path

    data = config.data
    every = config.eval.every
    if data.task is not None:
        seed = int(data.task_args.get("seed", 0))
        train = task_pairs(load_prompts(data, "train"), data.task, "train", seed)
        test = task_pairs(load_prompts(data, "test"), data.task, "test", seed) if every else []
    else:
        train = read_pairs(data.path)  # a JSONL file, or an RL run's folder (its rollouts: on-policy pairs)
        held = data.test_path or (data.path if Path(data.path).is_dir() else None)  # a run's held-out tenth
        test = read_pairs(held, part="test") if every and held else []
    test = test[: config.eval.limit] if config.eval.limit else test
    tokenizer = load_tokenizer(model_path(config.model.path))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise DataError(f"model.path {config.model.path}: the tokenizer has neither a pad nor an eos token to pad reward-model rows with")
    limit = config.train.max_seq_tokens
    pairs = [pair_ids(p, tokenizer, pad, limit) for p in train]
    records = [Prompt(p.prompt, None, {}, i, p.where) for i, p in enumerate(train)]
    held_out = [pair_ids(p, tokenizer, pad, limit) for p in test]
    return PairData(pairs, records, held_out, int(pad), every, config.eval.batch_size)


def pair_ids(pair: PreferencePair, tokenizer: Any, pad: int, limit: int | None) -> PairIds:
    """The reward model's token ids of both sides of ``pair``: what the scalar reward reads in an RL run."""
    from noria.rewards.scalar import rm_input_ids

    out = []
    for key in ("chosen", "rejected"):
        try:
            ids = rm_input_ids(tokenizer, pair.prompt, getattr(pair, key))
        except Exception as e:  # a chat template that fails on this row: name it
            raise DataError(f"{pair.where}: field '{key}': the chat template failed: {type(e).__name__}: {e}") from e
        if limit is not None and len(ids) > limit:
            raise DataError(
                f"{pair.where}: field '{key}': prompt + response are {len(ids)} tokens, more than train.max_seq_tokens "
                f"({limit}); a reward model must read the whole response: raise the limit or shorten the row"
            )
        if len(ids) < 2:
            raise DataError(f"{pair.where}: field '{key}': the rendered row has {len(ids)} token(s); a reward model reads at least 2")
        if ids[-1] == pad:
            raise DataError(
                f"{pair.where}: field '{key}': the rendered row ends with the pad token ({pad}), where a "
                "sequence-classification model stops reading: its score would not be the response's"
            )
        out.append(ids)
    return out[0], out[1]
