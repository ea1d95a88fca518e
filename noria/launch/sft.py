"""``noria train`` for ``train.algorithm: sft``: the supervised fine-tuning job.

It sits beside the RL job (``noria.launch.rl.run_rl``, the loop of ``noria.loop``); both write the
same run folder, whose name and resume checks are ``noria.run_folder``. The same loop trains a scalar
reward model (``train.algorithm: reward_model``): its data (``noria.launch.reward_model.PairData``)
answers the calls the loop makes of ``SFTData`` (``make_backend``, ``train_step``, ``evaluate``), with
preference pairs, the Bradley-Terry step and held-out pairwise accuracy in eval.jsonl.

The loop (``sft_loop``), one optimizer step per pass::

    chat JSONL --prepare_sft (validate + tokenize every row; errors name file:line) --> samples
    PromptSource (seeded shuffle per epoch, resumable cursor) --next_batch(global_batch)--> rows
      -> pack_samples -> backend.train_step (noria.train.build_backend) (sft_loss: token-mean NLL on assistant tokens)
      -> metrics.jsonl line (+ progress bar or plain line) -> every save_every steps: checkpoint
    after the last step: RUN_DIR/final/ (HF folder: transformers and ``noria eval`` load it)

Run folder (``noria.run_folder``)::

    RUN_DIR/config.yaml                  the resolved config
    RUN_DIR/metrics.jsonl                one line per optimizer step (rank 0 writes)
    RUN_DIR/events.jsonl                 one line per start (started, resumed, restarted) with its step
    RUN_DIR/checkpoints/step-000010/     DCP checkpoint; ``extra["data"]`` is the data cursor; the last
                                         step's one is saved at the end too (``train.save_final_state``)
    RUN_DIR/final/                       config.json + safetensors + tokenizer files

Resuming (``--resume RUN_DIR``) restores the last committed checkpoint (weights, AdamW, RNG, step)
and the data cursor, and moves the metrics lines written after that checkpoint to ``superseded/``
(``noria.run_folder.set_aside_after``), so the resumed run repeats exactly the steps an
uninterrupted run would take. A finished run resumed with a larger ``train.max_steps`` goes on from
its last step. The config must match the saved one except ``train.max_steps`` and ``run_dir``.

Distributed (``train.backend: fsdp2``, ``train.world_size`` > 1): under torchrun (``RANK`` set)
every rank runs the loop; otherwise ``run_sft`` spawns ``world_size`` local ranks itself on a free
loopback port. Data is validated once, before any rank starts or any model loads.

Not guaranteed: bitwise-equal losses after a resume hold on one process (not across a change of
world size).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noria.config import RunConfig, save_config
from noria.console import phase
from noria.data import PromptSource
from noria.data.chat import resolve_chat_template
from noria.errors import NoriaError
from noria.net import free_port
from noria.launch.continuation import checkpoint_due, resume_note, start_event
from noria.metrics import record_event
from noria.run_folder import check_run_folder, discard_unstarted, make_run_folder, resolve_run_dir, set_aside_after
from noria.train.checkpoint import checkpoint_dir, latest_checkpoint
from noria.train.sft import SFTDataError, chat_sample, read_chat_jsonl
from noria.types import Prompt, Sample

@dataclass
class SFTData:
    """The validated, tokenized training set, and what ``sft_loop`` asks of its data (the reward
    model's ``noria.launch.reward_model.PairData`` answers the same calls)."""

    samples: list[Sample]
    """One sample per chat row, in file order; loss mask 1 on assistant tokens."""
    records: list[Prompt]
    """The chat rows as prompt records (``index`` = position in ``samples``), for ``PromptSource``."""

    def make_backend(self, config: RunConfig) -> Any:
        """The trainer backend, not yet loaded: the NLL on assistant tokens."""
        from noria.train import build_backend
        from noria.train.losses import sft_loss

        return build_backend(config.train, loss_fn=sft_loss, model_impl=config.model.impl, seed=config.seed)

    def train_step(self, backend: Any, rows: list[Prompt]) -> dict[str, float]:
        """One optimizer step on ``rows``."""
        from noria.train.packing import pack_samples

        return backend.train_step(pack_samples([self.samples[r.index] for r in rows]))

    def evaluate(self, backend: Any, folder: Path, when: str) -> None:
        """SFT evaluates nothing during the run (``noria eval`` measures RUN_DIR/final)."""


def run_sft(config: RunConfig, run_dir: str | None = None, resume: str | None = None, progress: bool | None = None) -> Path:
    """The ``noria train`` job: validate data, then run the loop (spawning ranks if needed)."""
    if config.train.algorithm == "rl":
        raise NoriaError("train.algorithm rl runs through noria.launch.rl.run_rl (noria train picks it), not the SFT job")
    data = prepare_data(config)
    if os.environ.get("RANK") is not None:  # under torchrun
        return run_rank(config, data, run_dir, resume, progress)
    folder = resolve_run_dir(config, run_dir, resume)  # once: the default name holds the time
    with discard_unstarted(folder, resume is not None):  # a run that fails before step 1 leaves no folder
        if config.train.backend == "single":
            return sft_loop(config, data, None if resume else str(folder), resume, progress)
        check_run_folder(folder, config, resume is not None)  # once here, not as a crash on every rank
        spawn_ranks(config, data, folder, resume is not None, progress)
    return folder


# ------------------------------------------------------------------------------------- data


def prepare_data(config: RunConfig) -> Any:
    """The run's training data: chat rows (SFT), or preference pairs (``train.algorithm: reward_model``)."""
    if config.train.algorithm == "reward_model":
        from noria.launch.reward_model import prepare_pairs

        return prepare_pairs(config)
    return prepare_sft(config)


def prepare_sft(config: RunConfig) -> SFTData:
    """Read, validate and tokenize every chat row; errors name the file and line, no model loads."""
    from noria.models import load_tokenizer
    from noria.models.catalog import model_path

    path = config.data.path
    if not Path(path).is_file():
        raise SFTDataError(f"data.path {path}: file not found")
    rows = read_chat_jsonl(path)
    if not rows:
        raise SFTDataError(f"{path}: no chat rows")
    lines = row_lines(path)
    tokenizer = load_tokenizer(model_path(config.model.path))
    if isinstance(config.data.chat_template, str):  # a Jinja file or template of the config's own
        tokenizer.chat_template = resolve_chat_template(config.data.chat_template)
    samples = [
        truncate(chat_sample(messages, tokenizer, where=f"{path}:{line}"), config.train.max_seq_tokens)
        for messages, line in zip(rows, lines)
    ]
    records = [Prompt(tuple(m), None, {}, i, path) for i, m in enumerate(rows)]
    return SFTData(samples, records)


def row_lines(path: str | Path) -> list[int]:
    """1-based line numbers of the non-blank lines (the rows ``read_chat_jsonl`` returns)."""
    return [n for n, line in enumerate(Path(path).read_text().splitlines(), start=1) if line.strip()]


def truncate(sample: Sample, max_tokens: int | None) -> Sample:
    """Cut ``sample`` on the right to ``max_tokens`` tokens (prompt first, then response)."""
    if max_tokens is None or len(sample.prompt_ids) + len(sample.response_ids) <= max_tokens:
        return sample
    keep = max(max_tokens - len(sample.prompt_ids), 0)
    sample.prompt_ids = sample.prompt_ids[:max_tokens]
    sample.response_ids, sample.loss_mask = sample.response_ids[:keep], sample.loss_mask[:keep]
    return sample


def total_steps(config: RunConfig, n_rows: int) -> int:
    """Optimizer steps of the run: every epoch's rows in batches of ``global_batch``, capped by max_steps."""
    steps = math.ceil(n_rows * config.data.epochs / config.train.global_batch)
    return min(steps, config.train.max_steps) if config.train.max_steps else steps


# ------------------------------------------------------------------------------------- loop


def sft_loop(config: RunConfig, data: SFTData, run_dir: str | None, resume: str | None, progress: bool | None) -> Path:
    """The SFT loop on this process (one rank of it under FSDP2); see the module docstring."""
    from noria.models.catalog import model_path
    from noria.train.fsdp import init_distributed

    rank = init_distributed(config.train.device)[0] if config.train.backend == "fsdp2" else 0
    folder = agree_run_dir(config, run_dir, resume)
    check_run_folder(folder, config, resume is not None)
    source = PromptSource.from_config(data.records, config.data)
    steps = total_steps(config, len(data.records))
    with phase(f"loading the model {config.model.path} for training ({config.train.param_dtype}, {config.train.device})"):
        backend = data.make_backend(config)
        backend.init(model_path(config.model.path), total_steps=steps)
    event = restore(backend, source, folder, steps) if resume is not None else {}
    barrier()  # every rank has checked the saved config before rank 0 rewrites it
    if rank == 0:
        config.run_dir = str(folder)
        make_run_folder(folder)
        save_config(config, folder / "config.yaml")
        start = backend.optimizer_steps
        record_event(folder, "resumed" if start > 0 else "started", start, **event)
    log = StepLog(folder / "metrics.jsonl", rank == 0, steps, backend.optimizer_steps, progress)
    data.evaluate(backend, folder, "start")
    while backend.optimizer_steps < steps and not source.exhausted:
        rows = source.next_batch(config.train.global_batch)
        log.write(step_row(data.train_step(backend, rows), source.epoch))
        data.evaluate(backend, folder, "step")
        if checkpoint_due(config.train, backend.optimizer_steps, "step"):
            save_checkpoint(backend, source, folder)
    log.close()
    data.evaluate(backend, folder, "end")
    if checkpoint_due(config.train, backend.optimizer_steps, "end") and not checkpoint_dir(folder, backend.optimizer_steps).exists():
        save_checkpoint(backend, source, folder)  # what --resume needs to extend the finished run
    with phase(f"exporting the final model to {folder / 'final'}"):
        backend.export_hf(folder / "final")
    if rank == 0:
        print(f"noria train: {backend.optimizer_steps} steps; model in {folder / 'final'}", file=sys.stderr)
    return folder


# ------------------------------------------------------------------------------- run folder


def agree_run_dir(config: RunConfig, run_dir: str | None, resume: str | None) -> Path:
    """``resolve_run_dir`` on rank 0, shared with every rank (the default name has a timestamp)."""
    import torch.distributed as dist

    folder = [str(resolve_run_dir(config, run_dir, resume))]
    if dist.is_initialized():
        dist.broadcast_object_list(folder, src=0)
    return Path(folder[0])


def save_checkpoint(backend: Any, source: PromptSource, folder: Path) -> None:
    """The checkpoint of the current step, with the data cursor (collective on every rank)."""
    target = checkpoint_dir(folder, backend.optimizer_steps)
    with phase(f"saving checkpoint {target}"):
        backend.save(target, extra={"data": source.state_dict()})


def restore(backend: Any, source: PromptSource, folder: Path, total: int | None = None) -> dict[str, Any]:
    """Continue the run in ``folder`` from its last committed checkpoint (or from step 0 if it records
    nothing yet: ``noria.run_folder.check_continuable``); rank 0 moves what was recorded after that
    step aside and says so. Returns what the resume did, for events.jsonl."""
    ckpt = latest_checkpoint(folder)
    if ckpt is not None:
        extra = backend.load(ckpt)
        source.load_state_dict(extra["data"])
    step = backend.optimizer_steps
    if backend.rank != 0:
        return {}
    moved, where = set_aside_after(folder, step)
    total = step + 1 if total is None else total
    print(f"noria train: {resume_note(folder, step, total, ckpt, moved, where)}", file=sys.stderr)
    return start_event(folder, total, ckpt, moved, where)


# ---------------------------------------------------------------------------------- metrics


class StepLog:
    """metrics.jsonl plus a progress bar (on a TTY) or one plain line per step; rank 0 only."""

    def __init__(self, path: Path, active: bool, total: int, start: int, progress: bool | None) -> None:
        self.active = active
        self.total = total
        self.file = path.open("a") if active else None
        tty = sys.stderr.isatty() if progress is None else progress
        self.bar = None
        if active and tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", unit="step", file=sys.stderr)

    def write(self, row: dict[str, Any]) -> None:
        if not self.active:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}")
            self.bar.update(1)
        else:
            print(plain_line(row, self.total), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()


PAIR_METRICS = ("pair_accuracy", "margin")
"""A reward model's step figures (``noria.train.reward_model``), kept in its metrics.jsonl rows."""


def step_row(metrics: dict[str, float], epoch: int) -> dict[str, Any]:
    """One metrics.jsonl line: step, loss, grad_norm, lr, tokens, seconds (+ loss tokens, epoch)."""
    return {
        "step": int(metrics["step"]),
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "lr": metrics["lr"],
        "tokens": int(metrics["tokens"]),
        "loss_tokens": int(metrics["loss_tokens"]),
        "seconds": round(metrics["step_time_s"], 4),
        "epoch": epoch,
        "skipped": bool(metrics["skipped"]),
        **{k: metrics[k] for k in PAIR_METRICS if k in metrics},
    }


def plain_line(row: dict[str, Any], total: int) -> str:
    """The log line printed per step when stderr is not a terminal."""
    return (
        f"step {row['step']}/{total} loss {row['loss']:.4f} grad_norm {row['grad_norm']:.3f} "
        f"lr {row['lr']:.2e} tokens {row['tokens']} {row['tokens'] / max(row['seconds'], 1e-9):.0f} tok/s"
    ) + (f" pair acc {row['pair_accuracy']:.0%}" if "pair_accuracy" in row else "")


# ----------------------------------------------------------------------------- distributed


def spawn_ranks(config: RunConfig, data: SFTData, folder: Path, resume: bool, progress: bool | None) -> None:
    """Run ``world_size`` FSDP2 ranks as local processes (gloo on CPU, NCCL on CUDA)."""
    from noria.process import spawn
    from noria.train.fsdp import rank_process

    args = (_rank_main, config.train.world_size, free_port(), config, data, str(folder), resume, progress)
    spawn(rank_process, args, config.train.world_size)


def _rank_main(rank: int, world: int, port: int, config: RunConfig, data: SFTData, folder: str, resume: bool, progress) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    run_rank(config, data, folder, folder if resume else None, progress)


def run_rank(config: RunConfig, data: SFTData, run_dir: str | None, resume: str | None, progress: bool | None) -> Path:
    """``sft_loop`` as one FSDP2 rank, leaving the process group torn down."""
    from noria.train.fsdp import shutdown_distributed

    try:
        folder = sft_loop(config, data, run_dir, resume, progress)
    except BaseException:
        shutdown_distributed(clean=False)
        raise
    shutdown_distributed()
    return folder


def barrier() -> None:
    """Wait for every rank (no-op on one process)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
