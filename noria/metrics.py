"""The run log of ``noria train`` (RL): metric files, metric sinks, sampled trajectories, progress.

Files in the run folder::

    metrics.jsonl            one JSON object per rollout step (every name is in ``METRICS`` below)
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
and friends). ``METRICS`` is the one table of metric names, units and meanings: the docs
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noria import faults
from noria.errors import DiskError
from noria.types import Group, Status

SINKS = ("jsonl", "tensorboard", "wandb")


@dataclass(frozen=True)
class Metric:
    """One documented metric: ``name`` is exact, or a family ending in ``/*`` (e.g. a drop reason)."""

    name: str
    unit: str
    meaning: str
    group: str


def _table(group: str, rows: list[tuple[str, str, str]]) -> list[Metric]:
    return [Metric(name, unit, meaning, group) for name, unit, meaning in rows]


# The metric registry: every key of a metrics.jsonl row (RL) or eval.jsonl row.
METRICS: tuple[Metric, ...] = tuple(
    _table("step", [
        ("step", "count", "Rollout steps done (1-based; the row describes this step)."),
        ("version", "count", "Weight version the engines serve after the step (= number of weight syncs)."),
        ("seconds", "s", "Wall time of the whole step (rollout, reward, buffer, train, sync)."),
        ("groups/trained", "count", "Groups the trainer used this step."),
    ])
    + _table("rollout", [
        ("rollout/reward_mean", "reward", "Mean reward of the step's scored samples (failed ones excluded)."),
        ("rollout/response_len_mean", "tokens", "Mean response length."),
        ("rollout/truncated_frac", "fraction", "Samples that hit rollout.max_new_tokens."),
        ("rollout/aborted", "count", "Samples aborted by the engine."),
        ("rollout/groups_solved_frac", "fraction", "Groups with at least one sample of positive reward."),
        ("rollout/groups_zero_variance_frac", "fraction", "Groups whose samples all got the same reward (no signal for GRPO)."),
        ("rollout/groups_mixed_versions_frac", "fraction", "Trained groups whose policy tokens come from more than one weight version (asynchronous RL)."),
        ("rollout/tokens", "tokens", "Response tokens generated since the previous step."),
        ("rollout/trained_tokens", "tokens", "Response tokens of the groups trained this step."),
        ("rollout/tokens_per_s", "tokens/s", "Generation throughput: response tokens generated over the time it took."),
        ("rollout/in_flight", "count", "Trajectories generating when the step's metrics were taken."),
        ("rollout/in_flight_groups", "groups", "Groups started and not yet finished when the step's metrics were taken."),
        ("rollout/groups_finished", "groups", "Groups the rollout scheduler finished since the previous step."),
        ("rollout/groups_regenerated", "groups", "Groups started over since the previous step because their engine died (engine fleet)."),
        ("rollout/mixed_fleet_frac", "fraction", "Requests since the previous step served while the fleet's live engines held different weight versions."),
        ("fleet/engines", "count", "Engines of the fleet serving at the end of the step."),
        ("fleet/restarts", "count", "Engine restarts so far in the run (each after an engine died)."),
        ("fleet/added", "count", "Engines added to the running fleet so far (noria fleet add, or in place of the last one that left)."),
        ("fleet/removed", "count", "Engines that left the fleet so far, drained and stopped (noria fleet remove, or SIGTERM: preemption); not failures."),
        ("fleet/requests_moved", "count", "Requests so far that an engine leaving the fleet did not finish; their groups were generated again on the others."),
        ("engine/busy_frac", "fraction", "Share of the time since the previous step during which at least one trajectory was generating."),
        ("reward/scored", "count", "Samples the reward function scored."),
        ("reward/skipped", "count", "Samples not scored (aborted or failed generation)."),
        ("reward/failed", "count", "Samples whose reward call raised, timed out or returned a non-number."),
        ("reward/failed/*", "count", "Failed reward calls by kind; kinds: raised, timeout, not_a_number, non_finite; a judge's "
         "(reward.model) also: unparseable, unreachable, mismatch, timeout, raised."),
        ("reward/component/*", "reward", "With reward.model: the mean of each part of the reward (the rule's under reward.name, the judge's under reward.model.name) over the samples it scored."),
        ("reward/agreement", "fraction", "With reward.model and a rule: samples on which judge and rule agree (both >= reward.model.agreement_threshold, or both below)."),
        ("reward/model_latency_s_p50", "s", "With reward.model: median seconds of a judge request (answered ones, since the previous step)."),
        ("reward/model_latency_s_p99", "s", "With reward.model: 99th percentile of the judge's request seconds."),
        ("reward/model_cache_hits", "count", "With reward.model: samples whose verdict came from the judge's cache (same judge, prompt and response)."),
        ("engine/prefix_hit_rate", "fraction", "Share of the prompt tokens admitted since the previous step's line that the engine's radix prefix cache served (colocated engine)."),
        ("rollout/spec_acceptance", "fraction", "With engine.speculative: share of the drafted tokens the colocated engine accepted since the previous step's line."),
        ("rollout/spec_tokens_per_verify", "tokens", "With engine.speculative: tokens a verify chunk kept on average since the previous step's line (its accepted drafts + 1)."),
        ("engine/retractions", "count", "Requests retracted for lack of KV memory (colocated engine, cumulative)."),
        ("resume/in_flight_continued", "groups", "First step after a resume: groups in flight at the checkpoint continued from their recorded tokens (rollout.resume_in_flight)."),
        ("resume/in_flight_retracted", "groups", "First step after a resume: groups in flight at the checkpoint retracted, their prompts back to the data source (the reasons are in the run's log)."),
        ("resume/in_flight_tokens_kept", "tokens", "First step after a resume: response tokens of the continued groups sampled before the checkpoint (kept, not sampled again)."),
        ("engine/kv_usage", "fraction", "Share of the rollout engines' KV cache blocks in use when the step's line is written (right after its weight sync), mean over the engines."),
    ])
    + _table("buffer", [
        ("buffer/size", "groups", "Groups waiting in the buffer after the step's take."),
        ("buffer/capacity", "groups", "Most groups the buffer holds."),
        ("buffer/staleness_mean", "versions", "Mean staleness of the groups trained this step: trainer version minus the group's oldest policy-token version."),
        ("buffer/staleness_max", "versions", "Largest staleness among the groups trained this step."),
        ("buffer/waiting_staleness_mean", "versions", "Mean staleness of the groups still waiting."),
        ("buffer/waiting_staleness_max", "versions", "Largest staleness among the groups still waiting."),
        ("buffer/dropped/*", "count", "Groups dropped by reason, cumulative; reasons: no_trainable_sample, zero_reward_variance, over_length, stale; or a user filter's own."),
        ("buffer/generated_per_kept", "groups", "Groups generated per group kept since the last line (dynamic sampling's cost)."),
    ])
    + _table("curriculum", [
        ("curriculum/*", "prompts", "Difficulty pools (data.curriculum): easy_pool, hard_pool (prompts waiting in each); since "
         "the last line: revisits, skipped (passed over by the cursor: in a pool), pooled, released (a revisit scored mixed)."),
    ])
    + _table("train", [
        ("loss", "loss", "The step's total loss (policy term + KL and entropy terms), normalised over trained tokens."),
        ("policy_loss", "loss", "The aggregated policy-gradient term alone."),
        ("grad_norm", "norm", "Global gradient L2 norm before clipping."),
        ("lr", "1", "Learning rate of the last optimizer step."),
        ("clip_frac", "fraction", "Trained tokens whose importance ratio was clipped."),
        ("dual_clip_frac", "fraction", "Trained tokens clipped by dual-clip (ppo_clip, negative advantages)."),
        ("approx_kl", "nats/token", "k3 estimate of KL(old policy || current policy) over trained tokens (0 on the first optimizer step of a rollout)."),
        ("ref_kl", "nats/token", "KL(current || reference model) with train.loss.kl_estimator (only when kl_coef > 0)."),
        ("entropy", "nats/token", "Mean entropy of the trainer's next-token distribution (only when entropy_coef > 0)."),
        ("rollout_logprob_abs_diff", "nats", "Mean |trainer logprob - rollout engine logprob| of the sampled tokens (0 = exact agreement)."),
        ("rollout_logprob_abs_diff_max", "nats", "Largest |trainer logprob - rollout logprob| over the step's tokens."),
        ("rollout_kl", "nats/token", "k3 estimate of KL(rollout engine || trainer) on the sampled tokens."),
        ("is_weight_mean", "ratio", "Mean off-policy importance weight (train.loss.off_policy) over kept tokens."),
        ("is_weight_max", "ratio", "Largest importance weight."),
        ("is_weight_min", "ratio", "Smallest importance weight."),
        ("is_masked_frac", "fraction", "Tokens masked out by the off-policy correction (MIS)."),
        ("skipped", "flag", "1 when the optimizer step was skipped (non-finite loss or gradient)."),
        ("tokens", "tokens", "Tokens (prompt + response) through the trainer this step."),
        ("loss_tokens", "tokens", "Tokens with loss_mask 1 (trained on)."),
        ("step_time_s", "s", "Trainer time of the last optimizer step."),
        ("optimizer_step", "count", "Optimizer steps done so far."),
        ("train/samples", "count", "Samples trained on this step."),
        ("train/pairs", "count", "Image runs: (image, denoising step) pairs (Flow-GRPO) or (image, noise draw) pairs (DiffusionNFT) trained on."),
        ("nft/*", "loss", "DiffusionNFT: positive_loss and negative_loss (the weighted x0 errors of the implicit policies) and "
         "optimality_mean (mean optimality weight r in [0, 1])."),
        ("train/skipped_no_samples", "flag", "1 when no sample of the step could be trained on."),
        ("train/token_staleness_mean", "versions", "Mean over the trained policy tokens of the engines' weight version minus the version that sampled the token."),
        ("train/token_staleness_max", "versions", "Largest token staleness of the step (a group's staleness is that of its oldest token)."),
        ("critic/value_loss", "loss", "PPO with GAE: the critic's clipped value loss (0.5 * squared error), token mean."),
        ("critic/value_clip_frac", "fraction", "Trained tokens whose value update was clipped (train.critic.value_clip)."),
        ("critic/value_mean", "value", "Mean predicted value over trained tokens."),
        ("critic/explained_variance", "1", "1 - Var(returns - values) / Var(returns): 1 is a perfect critic, 0 no better than a constant."),
        ("critic/*", "varies", "The critic's optimizer-step figures (loss, grad_norm, lr, skipped, ...): same meaning as the policy's names."),
    ])
    + _table("opd", [
        ("opd/reverse_kl_mean", "nats/token", "On-policy distillation (train.loss.opd_coef > 0): mean over policy tokens of log pi_student - "
         "log pi_teacher of the sampled token (opd.top_k: the top-k KL per position); the advantages lose opd_coef times it."),
        ("opd/reverse_kl_max", "nats/token", "On-policy distillation: the largest per-token reverse KL of the step."),
        ("opd/teacher_latency_s", "s", "Teacher engines (opd.placement: engine): mean seconds to score one sample by prefill "
         "(during rollout, overlapping generation and training)."),
    ])
    + _table("moe", [
        ("moe/route_mismatch", "fraction", "MoE (rollout.routing_replay / record_routes): (policy token, MoE layer) pairs whose experts "
         "in the trainer's forward differ from the engine's; 0 with replay."),
        ("moe/router_disagreement", "fraction", "MoE: the same for the trainer router's own top-k (what it would choose), replay or not."),
        ("moe/router_aux_loss", "loss", "MoE (train.loss.router_aux_coef > 0): the routers' load-balancing loss, k at perfect balance."),
    ])
    + _table("time", [
        ("time/reward_s", "s", "Reward scoring of the groups finished since the last step (each group is scored when "
         "its samples finish, while others still generate: it overlaps the rollout stage, not adds to it)."),
        ("time/trainer_wait_s", "s", "Time the trainer waited for the step's batch of groups (the whole rollout when synchronous)."),
        ("time/train_s", "s", "Trainer: logprobs, loss, backward, optimizer step(s)."),
        ("time/teacher_s", "s", "On-policy distillation with the teacher in the trainer: its scoring of the step's samples (part of time/train_s)."),
    ])
    + _table("memory", [
        ("memory/peak_rss_gb", "GB", "Peak resident memory so far of the run's processes (the job and its living children: engines, "
         "eval fleet, ranks, router), each process's peak (VmHWM) summed."),
        ("memory/gpu_peak_allocated_gb", "GB", "CUDA: peak memory allocated by torch in the job's process so far."),
    ])
    + _table("session", [
        ("session/open", "count", "Agent sessions holding a place (rollout.session_max_open) when the step's metrics were taken."),
        ("session/admitted", "count", "Agent sessions let in so far in the run (cumulative)."),
        ("session/refused_open", "count", "First requests of agent sessions answered 429 for want of a place (rollout.session_max_open; cumulative)."),
        ("session/refused_tokens", "count", "Agent requests answered 413: the session would pass rollout.session_max_tokens (cumulative)."),
        ("session/closed_idle", "count", "Agent sessions closed after rollout.session_idle_timeout_s without a request (cumulative)."),
    ])
    + _table("sync", [
        ("sync/seconds", "s", "Weight push trainer -> engines (the engines serve the new version after it)."),
        ("sync/bytes", "bytes", "Bytes pushed, in the engines' dtype (counted once however many engines)."),
        ("sync/gb_per_s", "GB/s", "Push bandwidth (1e9 bytes per second)."),
        ("sync/tensors", "count", "Tensors pushed."),
        ("sync/verify_seconds", "s", "Checksum comparison after the push (sync.verify)."),
        ("sync/engines", "count", "Engines pushed to (a fleet, or with trainer ranks in their own processes)."),
        ("sync/fallback", "flag", "1 once a failed broadcast push made the run fall back to the disk transport."),
        ("sync/bytes_written", "bytes", "Disk transport: bytes of the folders the push wrote (with sync.delta: the delta, plus any full snapshot)."),
        ("sync/changed_frac", "fraction", "sync.delta: elements pushed whose bits differ from the last version (all of them on a first push)."),
        ("sync/full_snapshots", "count", "sync.delta: engines given a full snapshot (first push, an engine that missed a version or refused the delta)."),
        ("sync/delta_refused", "count", "sync.delta: engines that refused the delta (corrupt, or their weights were not its base) and got a full snapshot."),
    ])
    + _table("eval", [
        ("eval/accuracy", "fraction", "Held-out accuracy: mean reward over every evaluation answer, one whose reward failed counting as wrong (eval.jsonl `accuracy`)."),
        ("eval/reward_mean", "reward", "Image runs: mean of the run's reward over the evaluation images (accuracy is diffusion.eval_reward's)."),
        ("eval/diversity", "fraction", "Image runs: mean RMS pixel distance (0..1) between two evaluation images of the same condition; near 0 when RL collapses every seed onto one image."),
        ("eval/n_prompts", "count", "Prompts evaluated."),
        ("eval/n_answers", "count", "Answers scored (prompts x eval.n_samples)."),
        ("eval/failed", "count", "Answers without a reward (the reward failed, or generation aborted); counted as wrong in accuracy."),
        ("eval/truncated", "count", "Answers that hit eval.max_new_tokens."),
        ("eval/seconds", "s", "Wall time of the evaluation itself (fleet and checkpoint modes: from the start of its work, not its wait)."),
        ("eval/mode", "text", "Where it ran (eval.mode): shared, fleet or checkpoint."),
        ("eval/lag_steps", "steps", "Steps trained between the end of the measured step (the row's step) and the score being recorded; 0 in shared mode."),
        ("eval/lag_s", "s", "Seconds from the end of the measured step to the score being recorded (queueing, export and evaluation)."),
        ("eval/loop_wait_s", "s", "Seconds the training loop waited for this evaluation: shared mode, all of it; fleet and checkpoint, the wait for room (eval.overflow: wait) and the snapshot export."),
        ("eval/skipped", "text", "Why the evaluation was skipped (export failed, missing snapshot, too many in flight, backend error, version mismatch); the row has no accuracy."),
        ("eval/mean_version", "version", "Fleet mode: mean over answers of each answer's mean token weight version; must equal the row's version."),
        ("eval/mixed_version_frac", "fraction", "Fleet mode: share of answers generated by more than one weight version; must be 0."),
        ("eval/valid", "bool", "Fleet mode: 1 when every answer came from the evaluated version alone; 0 marks the accuracy invalid (left out of the report)."),
        ("eval/invalid_reason", "text", "Fleet mode: why the row is invalid."),
    ])
)  # fmt: skip


def metric_doc(name: str) -> Metric | None:
    """The registry entry of ``name``: the exact one, else the longest matching ``prefix/*`` family."""
    best = None
    for m in METRICS:
        if m.name == name:
            return m
        if m.name.endswith("/*") and name.startswith(m.name[:-1]) and (best is None or len(m.name) > len(best.name)):
            best = m
    return best


def undocumented(names: Iterable[str]) -> list[str]:
    """Names with no registry entry (what the docs test fails on)."""
    return sorted({n for n in names if metric_doc(n) is None})


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
        """(accuracy, step) of the newest evaluation: the step line shows it as ``eval 26.0% @0``."""
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
