"""The PPO value model (critic): GAE targets, value learning, PPO steps, checkpoints."""

from __future__ import annotations

import pytest
import torch

from noria.config import LossConfig
from noria.train.backend import TrainError
from noria.train.critic import CriticBackend, explained_variance, gae_targets, ppo_train
from noria.train.fsdp import FSDPBackend
from noria.train.packing import pack_samples
from noria.types import Sample
from train_util import critic_config, samples_with_rewards, weights


def test_gae_targets_with_gamma_and_lambda_one_give_reward_to_go():
    samples = samples_with_rewards()
    batch = pack_samples(samples)
    values = torch.rand(batch.n_tokens) * batch.loss_mask
    adv, ret = gae_targets(LossConfig(gamma=1.0, lam=1.0), batch, values, [s.reward for s in samples])
    trained = batch.loss_mask > 0
    cu = batch.cu_seqlens.tolist()
    for i, s in enumerate(samples):  # undiscounted, no bootstrapping: every return is the outcome reward
        seg = slice(cu[i], cu[i + 1])
        assert torch.allclose(ret[seg][trained[seg]], torch.full((int(trained[seg].sum()),), s.reward))
    assert torch.equal(adv[~trained], torch.zeros(int((~trained).sum())))
    assert torch.equal(ret[~trained], torch.zeros(int((~trained).sum())))
    # whitened over the trained tokens: A = (R - V - mean) / std
    raw = (ret - values)[trained]
    torch.testing.assert_close(adv[trained], (raw - raw.mean()) / (raw.std() + 1e-6), atol=1e-5, rtol=1e-5)


def test_gae_targets_discount_skips_tool_tokens():
    sample = Sample(prompt_ids=[5, 6], response_ids=[7, 8, 9, 10], loss_mask=[1, 0, 0, 1], reward=1.0)
    batch = pack_samples([sample])
    values = torch.zeros(batch.n_tokens)
    _adv, ret = gae_targets(LossConfig(gamma=0.5, lam=1.0), batch, values, [1.0])
    # the two policy tokens are consecutive steps for GAE: returns 0.5 and 1.0
    assert ret.tolist() == [0.0, 0.0, 0.5, 0.0, 0.0, 1.0]


def test_critic_learns_the_returns(tiny_model_dir):
    samples = samples_with_rewards()
    batch = pack_samples(samples)
    critic = CriticBackend(critic_config())
    critic.init(tiny_model_dir)
    trained = batch.loss_mask > 0
    v0 = critic.compute_values(batch)
    assert torch.equal(v0, torch.zeros_like(v0))  # zero-initialised head: no made-up baseline
    returns = torch.tensor([s.reward for s, n in zip(samples, torch.diff(batch.cu_seqlens).tolist()) for _ in range(n)])
    returns = returns * batch.loss_mask
    losses = []
    for _ in range(12):
        old = critic.compute_values(batch)
        m = critic.train_values(batch, returns, old)
        losses.append(m["critic/value_loss"])
        assert 0.0 <= m["critic/value_clip_frac"] <= 1.0 and m["critic/grad_norm"] > 0
    values = critic.compute_values(batch)
    assert losses[-1] < 0.3 * losses[0], losses
    assert explained_variance(values[trained], returns[trained]) > 0.5
    assert torch.equal(values[~trained], torch.zeros(int((~trained).sum())))


def test_value_clip_bounds_the_first_update(tiny_model_dir):
    """With a tiny clip range, a token whose new value left the range around V_old gets no gradient
    from the clipped term: the loss is the max of both, so clip_frac counts those tokens."""
    samples = samples_with_rewards()
    batch = pack_samples(samples)
    critic = CriticBackend(critic_config(value_clip=1e-4))
    critic.init(tiny_model_dir)
    returns = batch.loss_mask * 5.0
    old = critic.compute_values(batch)
    critic.train_values(batch, returns, old)
    m = critic.train_values(batch, returns, old)  # values moved past old +- 1e-4: clipped term is larger
    assert m["critic/value_clip_frac"] > 0.5


def test_ppo_train_updates_policy_and_critic(tiny_model_dir):
    cfg = critic_config()
    cfg.loss.advantage = "gae"
    policy = FSDPBackend(cfg)
    policy.init(tiny_model_dir)
    critic = CriticBackend(cfg)
    critic.init(tiny_model_dir)
    before_policy, before_head = weights(policy), critic.policy.value_head.weight.detach().clone()
    parts = ppo_train(policy, critic, samples_with_rewards(), cfg, steps=2)
    assert len(parts) == 2 and policy.optimizer_steps == 2 and critic.optimizer_steps == 2
    for m in parts:
        assert {"loss", "grad_norm", "critic/value_loss", "critic/grad_norm"} <= m.keys()
        assert m["skipped"] == 0.0 and m["critic/skipped"] == 0.0
    after_policy = weights(policy)
    assert any(not torch.equal(before_policy[k], after_policy[k]) for k in before_policy)
    assert not torch.equal(before_head, critic.policy.value_head.weight.detach())


def test_critic_checkpoint_round_trip_and_contract(tiny_model_dir, tmp_path):
    samples = samples_with_rewards()
    batch = pack_samples(samples)
    critic = CriticBackend(critic_config())
    critic.init(tiny_model_dir)
    returns = batch.loss_mask * 1.0
    critic.train_values(batch, returns, critic.compute_values(batch))
    saved = critic.compute_values(batch)
    critic.save(tmp_path / "ckpt")
    critic.train_values(batch, returns, saved)
    assert not torch.equal(critic.compute_values(batch), saved)
    fresh = CriticBackend(critic_config())
    fresh.init(tiny_model_dir)
    fresh.load(tmp_path / "ckpt")
    assert torch.equal(fresh.compute_values(batch), saved) and fresh.optimizer_steps == 1
    with pytest.raises(TrainError, match="not sent to rollout engines"):
        next(iter(critic.state_dict_for_sync(1 << 20)))
    with pytest.raises(TrainError, match="value head"):
        critic.export_hf(tmp_path / "hf")
    with pytest.raises(TrainError, match="train_values"):
        critic.train_step(batch)
