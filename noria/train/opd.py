"""On-policy distillation in the RL step: the in-trainer teacher, the advantage shaping, the metrics.

Per policy token t of a sample the student sampled, the reverse KL estimate is

    kl_t = log pi_s(y_t) - log pi_t(y_t)        (opd.top_k = 0: the sampled token)
    kl_t = KL(top-k student || top-k teacher)   (opd.top_k = k, see ``topk_kl``)

with ``log pi_s`` the behaviour policy's logprob (``Sample.rollout_logprobs``: the policy that
sampled, at the rollout temperature) and ``log pi_t`` the teacher's (``Sample.teacher_logprobs``).
The advantages become ``A_t - lambda * kl_t`` for any estimator's ``A`` (``train.loss.opd_coef``
= lambda), or ``-lambda * kl_t`` alone with ``opd.pure`` (pure distillation: the task reward is only
measured). Per-token advantages go into ``pack_samples`` as they are.

Where the teacher's logprobs come from: a teacher engine scored the samples during rollout
(``noria.distill.teacher``, the samples arrive with ``teacher_logprobs``), or the trainer's frozen
teacher (``train.teacher``, loaded by the backend beside the reference model and kept off the
accelerator between uses) scores every sample still without them here (``score_in_trainer``), on
the whole step's batch before the first optimizer step. In deterministic mode both give the same
bits (the engine's prefill scoring runs the trainer's numerics).

Blocking: ``score_in_trainer`` runs a no-grad forward of the teacher on the calling thread.
Not guaranteed: PPO with GAE (``advantage: gae``) is refused when distilling (its per-token
advantages come from the critic; shaping them is not done); cross-tokenizer distillation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from noria.types import Sample


def score_in_trainer(backend: Any, samples: Sequence[Sample]) -> float:
    """Fill ``teacher_logprobs`` of the samples that lack them with the backend's frozen teacher
    (``compute_logprobs(which="teacher")``); returns the seconds it took (0 when none lacked them)."""
    from noria.train.packing import pack_samples

    todo = [s for s in samples if s.teacher_logprobs is None]
    if not todo:
        return 0.0
    t0 = time.perf_counter()
    batch = pack_samples(todo)
    logprobs = backend.compute_logprobs(batch, which="teacher", trained_only=True).logprobs
    for s, lo in zip(todo, batch.cu_seqlens[:-1].tolist()):
        p, r = len(s.prompt_ids), len(s.response_ids)
        values = logprobs[lo + p : lo + p + r].tolist()
        s.teacher_logprobs = [v if m else 0.0 for v, m in zip(values, s.loss_mask)]
    return time.perf_counter() - t0


def token_kl(sample: Sample, top_k: int = 0) -> list[float]:
    """kl_t per response token (0 where ``loss_mask`` is 0); see the module docstring."""
    if sample.teacher_logprobs is None or len(sample.teacher_logprobs) != len(sample.response_ids):
        raise ValueError(
            f"sample {sample.group_id}/{sample.index} has no teacher logprob for each of its {len(sample.response_ids)} "
            "response tokens: distillation needs every trained sample scored by the teacher"
        )
    if top_k:
        if sample.rollout_top_logprobs is None or sample.teacher_top_logprobs is None:
            raise ValueError(f"sample {sample.group_id}/{sample.index}: opd.top_k needs the student's and the teacher's top-k")
        pairs = zip(sample.rollout_top_logprobs, sample.teacher_top_logprobs)
        return [topk_kl(s, t) if m else 0.0 for (s, t), m in zip(pairs, sample.loss_mask)]
    pairs = zip(sample.rollout_logprobs, sample.teacher_logprobs)
    return [(s - t) if m else 0.0 for (s, t), m in zip(pairs, sample.loss_mask)]


def topk_kl(student: Sequence[Sequence[float]], teacher: Sequence[Sequence[float]]) -> float:
    """KL(student || teacher) over the union of both top-k lists ((token id, logprob) pairs).

    A token missing from one side's list gets that side's smallest listed logprob (an upper bound
    of its true value), then each side is renormalised over the union. 0 when both lists are
    equal. An approximation of the full-vocabulary KL, exact when the top-k hold all the mass."""
    s = {int(i): float(lp) for i, lp in student}
    t = {int(i): float(lp) for i, lp in teacher}
    if not s or not t:
        return 0.0
    s_floor, t_floor = min(s.values()), min(t.values())
    union = sorted(s.keys() | t.keys())
    ls = [s.get(v, s_floor) for v in union]
    lt = [t.get(v, t_floor) for v in union]
    zs, zt = _logsumexp(ls), _logsumexp(lt)
    return max(0.0, sum(math.exp(a - zs) * ((a - zs) - (b - zt)) for a, b in zip(ls, lt)))


def _logsumexp(xs: Sequence[float]) -> float:
    top = max(xs)
    return top + math.log(sum(math.exp(x - top) for x in xs))


def shape_advantages(
    samples: Sequence[Sample], advantages: Sequence[float], coef: float, pure: bool, top_k: int = 0
) -> tuple[list[list[float]], dict[str, float]]:
    """Per-token advantages ``A - coef * kl_t`` (``pure``: ``-coef * kl_t``) for each sample, and the
    ``opd/*`` metrics of the step (reverse KL mean and per-token max over policy tokens)."""
    shaped, kls = [], []
    for s, a in zip(samples, advantages):
        kl = token_kl(s, top_k)
        base = 0.0 if pure else float(a)
        shaped.append([base - coef * k for k in kl])
        kls += [k for k, m in zip(kl, s.loss_mask) if m]
    metrics = {"opd/reverse_kl_mean": sum(kls) / len(kls) if kls else 0.0, "opd/reverse_kl_max": max(kls, default=0.0)}
    return shaped, metrics


def teacher_latency(samples: Sequence[Sample]) -> dict[str, float]:
    """Mean seconds a teacher engine took to score one sample (set during rollout), if any did."""
    times = [float(s.metadata["teacher_s"]) for s in samples if "teacher_s" in s.metadata]
    return {"opd/teacher_latency_s": sum(times) / len(times)} if times else {}
