"""What lets a run go on: the checkpoint a finished run leaves, and the restore of ``--resume``.

- ``checkpoint_due``: when the RL job (``noria.launch.job.LocalJob.save``) and the SFT loop
  (``noria.launch.sft``) write a checkpoint: every ``train.save_every`` steps, and at the end of the
  run (``train.save_final_state``, on by default, even with ``save_every`` 0), so that
  ``noria train --resume RUN --train.max_steps N`` extends a finished run from where it ended;
- ``restore_rl``: an RL job resuming from its last committed checkpoint: weights, AdamW, RNG, the
  data cursor, the groups in flight and waiting, the step, the group counter and the weight
  version; what the run recorded after that step is moved aside, never deleted
  (``noria.run_folder.set_aside_after``), and the start is described for ``events.jsonl``
  (``start_event``);
- ``resume_note``: the line a resume prints (where from, what was moved where).

The checks before a resume (is there anything to continue from, is the config the same) are
``noria.run_folder.check_run_folder``'s, done before any model loads.

Not guaranteed: a run extended with a decaying learning-rate schedule whose length is the run's
step count (``train.optim.total_steps`` null, schedule ``linear`` or ``cosine``) decays over the new
count from the resumed step on, so it is not the run that would have been made with the longer
count from the start; with ``constant`` (the default) or a fixed ``total_steps`` it is, bitwise.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from noria.config.train import TrainConfig


def checkpoint_due(train: TrainConfig, step: int, when: str) -> bool:
    """Whether a checkpoint is written after ``step`` at ``when`` (``step`` or ``end``): every
    ``save_every`` steps, and at the end with ``save_final_state`` (without it, only where the last
    step is a multiple of ``save_every``)."""
    if step <= 0:
        return False
    if train.save_every and step % train.save_every == 0:
        return True
    return when == "end" and train.save_final_state


def restore_rl(job: Any) -> None:
    """``--resume``: put ``job`` (a ``noria.launch.job.LocalJob``) where its last committed checkpoint
    left the run, move what was recorded after that step aside, and say so."""
    from noria.launch.parts import critic_checkpoint, drafter_checkpoint
    from noria.run_folder import set_aside_after
    from noria.train import latest_checkpoint

    ckpt = latest_checkpoint(job.folder)
    if ckpt is not None:
        extra = job.backend.load(ckpt)
        if job.critic is not None:
            job.critic.load(critic_checkpoint(ckpt))
        job.step = int(extra["rl_step"])
        job.next_group_id = int(extra["next_group_id"])
        job.trained_groups = int(extra.get("trained_groups", job.step * job.config.rollout.prompts_per_step))
        # "version": the key of checkpoints written before the weight version had one owner.
        job.weight_version = int(extra["weight_version"] if "weight_version" in extra else extra["version"])
        job.source.load_state_dict(extra["data"])
        job.buffer.load_state_dict(extra["buffer"])
        job.in_flight_record = extra.get("in_flight")  # continued or retracted when the rollout starts
        if drafter_checkpoint(ckpt).exists() and getattr(job, "local_engine", None) is not None:
            job.local_engine.load_drafter(drafter_checkpoint(ckpt))  # the mlp drafter as it was
    moved, where = set_aside_after(job.folder, job.step)
    job.evals.last_step = job.step if job.step > 0 else None
    print(f"noria train: {resume_note(job.folder, job.step, job.total_steps, ckpt, moved, where)}", file=sys.stderr)
    job.start_event = start_event(job.folder, job.total_steps, ckpt, moved, where)


def start_event(folder: Path, total_steps: int, ckpt: Path | None, moved: dict[str, int], where: Path | None) -> dict[str, Any]:
    """What a resume did, for its ``events.jsonl`` line (``noria.metrics.record_event``)."""
    event: dict[str, Any] = {"checkpoint": ckpt.name if ckpt else None, "total_steps": total_steps}
    if where is not None:
        event["superseded"] = {"folder": str(where.relative_to(folder)), **moved}
    return event


def resume_note(folder: Path, step: int, total: int, ckpt: Path | None, moved: dict[str, int], where: Path | None) -> str:
    """``resuming RUN at step k (checkpoints/step-k); ...``: where from, what moved where, what is left to do."""
    if ckpt is None:
        text = f"resuming {folder} at step 0 (nothing was recorded there yet)"
    else:
        text = f"resuming {folder} at step {step} ({ckpt.relative_to(folder)})"
    if where is not None:
        counts = ", ".join(f"{name} {n} {'row' if name.endswith('.jsonl') else 'file'}{'s' if n > 1 else ''}" for name, n in moved.items())
        text += f"; what was recorded after step {step} ({counts}) was moved, not deleted, to {where}"
    if step >= total:
        text += f"; it is already at step {step} of {total}: nothing to train (a larger --train.max_steps extends it)"
    return text
