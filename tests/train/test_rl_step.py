"""The RL step of noria.train.rl_step, as every launcher runs it: trainable samples, slices, old logprobs, metrics."""

from __future__ import annotations

import torch

from noria.train.rl_step import rl_step, token_staleness
from noria.train.packing import pack_samples
from noria.types import Group, Prompt, Sample, Status
from train_util import make_backend, random_samples, weights


def groups_of(samples: list[Sample], size: int, versions: list[int]) -> list[Group]:
    """Groups of ``size`` samples; sample i's policy tokens carry ``versions[i % len(versions)]``;
    rewards alternate so every group has signal."""
    out = []
    for g in range(len(samples) // size):
        part = samples[g * size : (g + 1) * size]
        for i, s in enumerate(part):
            s.group_id, s.index = g, i
            s.reward = float(i % 2)
            s.status = Status.COMPLETED
            v = versions[(g * size + i) % len(versions)]
            s.weight_versions = [v if m else -1 for m in s.loss_mask]
        out.append(Group(group_id=g, prompt=Prompt("p", None, {}, g, "test"), samples=tuple(part)))
    return out


def rl_backend(model_dir, k: int):
    return make_backend(model_dir, loss_fn=None, algorithm="rl", steps_per_rollout=k, global_batch=4)


def test_two_optimizer_steps_per_rollout_train_every_trainable_sample(tiny_model_dir):
    backend = rl_backend(tiny_model_dir, k=2)
    before = weights(backend)
    groups = groups_of(random_samples(8, seed=1), size=4, versions=[3, 5])
    groups[1].samples[0].status = Status.ABORTED  # never trained
    groups[1].samples[1].reward = None  # its reward failed: never trained
    out = rl_step(backend, groups, backend.cfg, weight_version=6)
    assert backend.optimizer_steps == 2 and out["optimizer_step"] == 2.0
    assert out["train/samples"] == 6.0
    assert out["train/token_staleness_max"] == 3.0  # version 6 trains tokens sampled by version 3
    assert 1.0 < out["train/token_staleness_mean"] < 3.0
    assert out["time/train_s"] > 0 and "loss" in out and "approx_kl" in out
    assert any(not torch.equal(before[n], t) for n, t in weights(backend).items())


def test_a_step_without_trainable_samples_trains_nothing(tiny_model_dir):
    backend = rl_backend(tiny_model_dir, k=1)
    groups = groups_of(random_samples(4, seed=2), size=4, versions=[0])
    for s in groups[0].samples:
        s.status = Status.FAILED
    out = rl_step(backend, groups, backend.cfg, weight_version=1)
    assert out["train/skipped_no_samples"] == 1.0 and backend.optimizer_steps == 0


def test_token_staleness_counts_trained_policy_tokens_only():
    samples = random_samples(3, seed=3)
    for s, v in zip(samples, (2, 4, 4)):
        s.weight_versions = [v] * len(s.response_ids)
    batch = pack_samples(samples)
    trained = batch.weight_versions[(batch.loss_mask > 0) & (batch.weight_versions >= 0)]
    expected = (5 - trained).double()
    got = token_staleness([batch], 5)
    assert got["train/token_staleness_max"] == 3.0
    assert abs(got["train/token_staleness_mean"] - float(expected.mean())) < 1e-9
    assert token_staleness([pack_samples([Sample(prompt_ids=[1], response_ids=[2], loss_mask=[0])])], 5) == {}
