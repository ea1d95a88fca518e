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


def test_samples_without_gradient_are_left_out_and_the_gradient_is_the_same(tiny_model_dir):
    """Groups whose rewards are all equal have advantage 0 on every token: left out of the forward and
    backward (train.skip_zero_advantage), the step's gradient, loss and normalisers are unchanged."""
    from train_util import record_grads

    def step(skip: bool, rewards: list[list[float]], **loss):
        backend = make_backend(tiny_model_dir, loss_fn=None, algorithm="rl", steps_per_rollout=1, skip_zero_advantage=skip, loss=loss)
        groups = groups_of(random_samples(4 * len(rewards), seed=4), size=4, versions=[0])
        for group, values in zip(groups, rewards):
            for s, r in zip(group.samples, values):
                s.reward = r
        grads = record_grads(backend)
        return rl_step(backend, groups, backend.cfg, weight_version=0), grads

    mixed = [[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    (full, g_full), (part, g_part) = step(False, mixed), step(True, mixed)
    assert full["train/zero_advantage_skipped_frac"] == 0.0 and part["train/zero_advantage_skipped_frac"] == 8 / 12
    assert part["tokens"] == full["tokens"] and part["loss_tokens"] == full["loss_tokens"]  # the step's work, as before
    assert abs(part["loss"] - full["loss"]) < 1e-6 and abs(part["grad_norm"] - full["grad_norm"]) < 1e-5 * full["grad_norm"]
    assert g_full.keys() == g_part.keys() and full["grad_norm"] > 0
    for name, grad in g_full.items():
        torch.testing.assert_close(g_part[name], grad, rtol=1e-4, atol=1e-7, msg=name)

    flat = [[1.0] * 4, [0.0] * 4]  # no signal at all: one sample still goes through, the optimizer steps on zeros
    out, grads = step(True, flat)
    assert out["train/zero_advantage_skipped_frac"] == 7 / 8 and out["optimizer_step"] == 1.0 and out["grad_norm"] == 0.0
    assert "rollout_logprob_abs_diff" in out and all(not g.any() for g in grads.values())

    entropy, _ = step(True, mixed, entropy_coef=0.01)  # a term every token has a gradient from: nothing left out
    assert entropy["train/zero_advantage_skipped_frac"] == 0.0


def test_a_policy_loss_not_declared_advantage_scaled_trains_every_sample(tiny_model_dir):
    """A plugin's policy loss may have a term that does not scale with the advantage: unless it is
    registered with advantage_scaled=True, no sample is left out."""
    from noria.train.algorithms.policy import POLICY_LOSSES, ppo_clip, register_policy_loss

    register_policy_loss("ppo_clip_plugin_copy")(ppo_clip)
    try:
        backend = make_backend(tiny_model_dir, loss_fn=None, algorithm="rl", steps_per_rollout=1,
                               loss={"policy_loss": "ppo_clip_plugin_copy"})
        groups = groups_of(random_samples(8, seed=5), size=4, versions=[0])
        for s in groups[1].samples:
            s.reward = 1.0  # no signal in the second group
        assert rl_step(backend, groups, backend.cfg, weight_version=0)["train/zero_advantage_skipped_frac"] == 0.0
    finally:
        POLICY_LOSSES.pop("ppo_clip_plugin_copy")
