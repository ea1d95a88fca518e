"""The metric registry: every key of a ``metrics.jsonl`` row (RL) or ``eval.jsonl`` row, with its unit
and meaning.

What this module owns: ``METRICS``, the one table of metric names; ``docs/metrics.md`` is generated
from it (``noria docs``), ``noria report`` explains each plotted key with it (``metric_doc``), and a
test fails when the loop logs a name it lacks (``undocumented``). A name is exact, or a family ending
in ``/*`` (a drop reason, a reward component).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


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
        ("rollout/spec_drafter_loss", "nats", "With engine.speculative.method mlp: the drafter's last training loss (state regression + 0.1 x token cross-entropy, per position; noria.engine.drafter)."),
        ("rollout/spec_drafter_train_s", "s", "With engine.speculative.method mlp: seconds the colocated engine spent training its drafter since the previous step's line (while it had no request)."),
        ("rollout/spec_fallbacks", "count", "With engine.speculative: times the colocated engine fell back to plain decoding for acceptance below engine.speculative.min_acceptance (cumulative)."),
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
        ("buffer/by_staleness/*", "tokens", "Asynchronous runs: <k>/response_len_mean (tokens) and <k>/reward_mean of the "
         "samples trained at staleness k since the last line (length bias: long answers finish late, so train staler)."),
        ("buffer/stale_dropped_len_mean", "tokens", "Asynchronous runs: mean response length of the samples dropped as stale "
         "since the last line (compare with buffer/by_staleness/*)."),
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
        ("pair_accuracy", "fraction", "Reward models (train.algorithm reward_model): share of the step's preference pairs scored r(chosen) > r(rejected); their `loss` is the mean -log sigmoid(r(chosen) - r(rejected))."),
        ("margin", "reward", "Reward models: mean r(chosen) - r(rejected) over the step's pairs."),
        ("tokens", "tokens", "Tokens (prompt + response) of the samples trained this step, a token several share counted in each "
         "(samples left out of the forward by train.skip_zero_advantage included); train tok/s is this over time/train_s."),
        ("loss_tokens", "tokens", "Tokens with loss_mask 1 (trained on)."),
        ("step_time_s", "s", "Trainer time of the last optimizer step."),
        ("optimizer_step", "count", "Optimizer steps done so far."),
        ("train/samples", "count", "Samples trained on this step."),
        ("train/zero_advantage_skipped_frac", "fraction",
         "Share of the step's samples left out of the forward and backward because their gradient is zero (train.skip_zero_advantage)."),
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
        ("time/reward_s", "s", "Reward scoring of the groups finished since the last step, summed over scoring calls "
         "(each sample is scored when it finishes, reward.score_each_sample; it overlaps the rollout stage)."),
        ("time/reward_hidden_s", "s", "Of time/reward_s: scoring done while the sample's group was still generating."),
        ("time/trainer_wait_s", "s", "Time the trainer waited for the step's batch of groups (the whole rollout when synchronous)."),
        ("time/train_s", "s", "Trainer: logprobs, loss, backward, optimizer step(s)."),
        ("time/optimizer_offload_s", "s", "train.offload_optimizer: moving the optimizer state to host memory and back this step."),
        ("time/teacher_s", "s", "On-policy distillation with the teacher in the trainer: its scoring of the step's samples (part of time/train_s)."),
    ])
    + _table("memory", [
        ("memory/peak_rss_gb", "GB", "Peak resident memory so far of the run's processes (the job and its living children: engines, "
         "eval fleet, ranks, router), each process's peak (VmHWM) summed."),
        ("memory/gpu_peak_allocated_gb", "GB", "CUDA: peak memory allocated by torch in the job's process so far."),
        ("memory/optimizer_offloaded_gb", "GB", "train.offload_optimizer: the optimizer state held in host memory while the "
         "colocated engine generates (freed on the GPU)."),
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
        ("eval/pair_accuracy", "fraction", "Reward models: share of the held-out pairs scored r(chosen) > r(rejected) (eval.jsonl `pair_accuracy`, with `margin`, `loss` and `n_pairs`)."),
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
