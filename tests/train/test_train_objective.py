"""rl_loss: composition against a hand computation, micro-batch invariance of the gradient, metrics (CPU, fast)."""

import itertools
import math

import pytest
import torch

from noria.config import LossConfig
from noria.errors import NoriaError
from noria.train.objective import LossNorm, reduce_metrics, rl_loss


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


def test_rl_loss_matches_a_hand_computation():
    cfg = LossConfig(policy_loss="ppo_clip", off_policy="tis", is_cap=1.5, aggregation="token_mean",
                     kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    lp = [-1.0, -0.5, -2.0, -0.3, -0.8]
    old = [-1.0, -0.9, -1.0, -0.35, -0.8]
    rollout = [0.0, -1.0, -1.1, -0.3, -1.5]
    adv = [0.0, 1.0, -1.0, 1.0, -0.5]
    mask = [0.0, 1.0, 1.0, 1.0, 1.0]
    ref = [-1.0, -0.6, -1.5, -0.3, -0.7]
    ent = [0.3, 0.5, 1.0, 0.2, 0.4]
    seq = [0, 0, 0, 1, 1]
    norm = LossNorm(total_tokens=10, total_seqs=4)  # the step holds other micro-batches too

    expected, diffs, weights, clipped = 0.0, [], [], 0.0
    for i in range(5):
        if not mask[i]:
            continue
        r = math.exp(lp[i] - old[i])
        surrogate = max(-adv[i] * r, -adv[i] * min(max(r, 0.8), 1.28))
        clipped += float(-adv[i] * min(max(r, 0.8), 1.28) > -adv[i] * r)
        w = min(math.exp(old[i] - rollout[i]), 1.5)
        expected += (surrogate * w + 0.1 * (lp[i] - ref[i]) - 0.01 * ent[i]) / 10
        diffs.append(old[i] - rollout[i])
        weights.append(w)

    lp_t = t(*lp).requires_grad_(True)
    loss, metrics = rl_loss(cfg, logprobs=lp_t, old_logprobs=t(*old), rollout_logprobs=t(*rollout), advantages=t(*adv),
                            loss_mask=t(*mask), seq_index=torch.tensor(seq), norm=norm, entropy=t(*ent), ref_logprobs=t(*ref))
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["loss"] == pytest.approx((expected, 0.4))  # 4 of the step's 10 tokens
    assert metrics["clip_frac"] == (clipped, 4.0) and clipped == 2.0  # tokens 1 (A > 0, r = 1.49) and 2 (A < 0, r = 0.37)
    assert metrics["ref_kl"] == pytest.approx((sum(lp[i] - ref[i] for i in range(1, 5)), 4.0))
    assert metrics["entropy"] == pytest.approx((sum(ent[1:]), 4.0))
    assert metrics["approx_kl"] == pytest.approx((sum(math.exp(x - o) - (x - o) - 1 for o, x in zip(old[1:], lp[1:])), 4.0))
    assert metrics["rollout_logprob_abs_diff"] == pytest.approx((sum(abs(d) for d in diffs), 4.0))
    assert metrics["rollout_logprob_abs_diff_max"] == pytest.approx((max(abs(d) for d in diffs), 0.0))
    assert metrics["rollout_kl"] == pytest.approx((sum(math.exp(d) - d - 1 for d in diffs), 4.0))
    assert metrics["is_weight_mean"] == pytest.approx((sum(weights), 4.0))
    assert metrics["is_weight_max"] == pytest.approx((1.5, 0.0)) and metrics["is_weight_min"] == pytest.approx((min(weights), 0.0))
    assert metrics["is_masked_frac"] == (0.0, 4.0)


def _step(seed=0, n_seqs=6):
    """A step of n_seqs packed sequences (2 prompt tokens each, then 2..7 response tokens, one tool token)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 10, (n_seqs,), generator=gen).tolist()
    n = sum(lengths)
    seq_of_token = torch.repeat_interleave(torch.arange(n_seqs), torch.tensor(lengths))
    mask = torch.ones(n)
    start = 0
    for length in lengths:
        mask[start : start + 2] = 0  # prompt
        mask[start + 3] = 0  # a tool token inside the response
        start += length
    old = -torch.rand(n, generator=gen) * 3
    return {
        "lengths": lengths,
        "seq": seq_of_token,
        "mask": mask,
        "lp": old + torch.randn(n, generator=gen) * 0.3,
        "old": old,
        "rollout": old + torch.randn(n, generator=gen) * 0.4,
        "adv": torch.randn(n_seqs, generator=gen)[seq_of_token] * mask,
        "ref": old + torch.randn(n, generator=gen) * 0.2,
        "entropy": torch.rand(n, generator=gen) * 2,
    }


def _grads(cfg, step, split):
    """Sum rl_loss over micro-batches of consecutive sequences; returns (lp grad, entropy grad, metric parts)."""
    lp = step["lp"].clone().requires_grad_(True)
    entropy = step["entropy"].clone().requires_grad_(True)
    bounds = [0, *itertools.accumulate(step["lengths"])]
    spans, seqs, first = [], [], 0
    for count in split:
        a, b = bounds[first], bounds[first + count]
        spans.append((a, b))
        seqs.append(step["seq"][a:b] - first)
        first += count
    norm = LossNorm.from_masks([step["mask"][a:b] for a, b in spans], seqs)
    parts = []
    for (a, b), seq in zip(spans, seqs):
        loss, metrics = rl_loss(cfg, logprobs=lp[a:b], old_logprobs=step["old"][a:b], rollout_logprobs=step["rollout"][a:b],
                                advantages=step["adv"][a:b], loss_mask=step["mask"][a:b], seq_index=seq, norm=norm,
                                entropy=entropy[a:b], ref_logprobs=step["ref"][a:b])
        loss.backward()
        parts.append(metrics)
    return lp.grad, entropy.grad, parts


CONFIGS = [
    LossConfig(aggregation=agg, policy_loss=pl, off_policy=op, kl_coef=0.05, entropy_coef=0.01, seq_sum_divisor=div,
               clip_low=0.1 if pl == "gspo" else 0.2, clip_high=0.1 if pl == "gspo" else 0.28, dual_clip=3.0 if pl == "ppo_clip" else None)
    for agg, div in [("token_mean", None), ("seq_mean_token_mean", None), ("seq_mean_token_sum", None), ("seq_mean_token_sum", 16.0)]
    for pl in ("ppo_clip", "gspo", "cispo")
    for op in ("none", "tis", "mis", "seq_is")
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.aggregation}-{c.seq_sum_divisor}-{c.policy_loss}-{c.off_policy}")
def test_gradient_does_not_depend_on_the_micro_batch_split(cfg):
    step = _step()
    lp_1, ent_1, parts_1 = _grads(cfg, step, [6])  # 1 micro-batch of 6 sequences
    lp_n, ent_n, parts_n = _grads(cfg, step, [1] * 6)  # 6 micro-batches of 1
    lp_m, ent_m, _ = _grads(cfg, step, [2, 3, 1])
    assert lp_1.abs().sum() > 0 and ent_1.abs().sum() > 0
    for grad in (lp_n, lp_m):
        torch.testing.assert_close(grad, lp_1, rtol=1e-5, atol=1e-7)
    for grad in (ent_n, ent_m):
        torch.testing.assert_close(grad, ent_1, rtol=1e-5, atol=1e-7)
    whole, split = reduce_metrics(parts_1), reduce_metrics(parts_n)
    assert whole.keys() == split.keys()
    for key in whole:
        assert split[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key  # sums of fp32 terms of either sign


def test_masked_tokens_never_leak_into_loss_or_gradient():
    step = _step(seed=3)
    keep = step["mask"] > 0
    old = torch.where(keep, step["old"], torch.full_like(step["old"], -1e4))  # absurd values off the mask
    rollout = torch.where(keep, step["rollout"], torch.full_like(step["old"], 1e4))
    for name in ("ppo_clip", "gspo", "cispo"):
        for correction in ("none", "tis", "mis", "seq_is"):
            lp = step["lp"].clone().requires_grad_(True)
            loss, metrics = rl_loss(LossConfig(policy_loss=name, off_policy=correction), logprobs=lp, old_logprobs=old,
                                    rollout_logprobs=rollout, advantages=step["adv"] + 5 * (~keep), loss_mask=step["mask"],
                                    seq_index=step["seq"], norm=LossNorm.from_masks([step["mask"]], [step["seq"]]))
            loss.backward()
            assert math.isfinite(loss.item()) and torch.isfinite(lp.grad).all()
            assert lp.grad[~keep].abs().max().item() == 0.0
            assert all(math.isfinite(v) for pair in metrics.values() for v in pair)


def test_mis_masked_tokens_count_in_metrics():
    cfg = LossConfig(off_policy="mis", mis_low=0.5, mis_high=2.0)
    _, metrics = rl_loss(cfg, logprobs=t(-1.0, -1.0, -1.0), old_logprobs=t(-1.0, -1.0, -1.0), rollout_logprobs=t(-1.0, -3.0, -1.5),
                         advantages=t(1.0, 1.0, 1.0), loss_mask=t(1, 1, 1), seq_index=torch.tensor([0, 0, 0]), norm=LossNorm(3, 1))
    assert metrics["is_masked_frac"] == (1.0, 3.0)  # ratio e^2 is outside [0.5, 2]
    assert metrics["is_weight_mean"] == pytest.approx((1.0 + math.exp(0.5), 2.0))
    assert metrics["is_weight_min"] == (1.0, 0.0)


def test_reduce_metrics_adds_means_and_takes_extremes():
    parts = [{"loss": (0.3, 0.25), "entropy": (2.0, 4.0), "is_weight_max": (1.5, 0.0), "is_weight_min": (0.9, 0.0)},
             {"loss": (0.5, 0.75), "entropy": (1.0, 1.0), "is_weight_max": (1.2, 0.0), "is_weight_min": (0.7, 0.0)}]
    assert reduce_metrics(parts) == pytest.approx({"loss": 0.8, "entropy": 0.6, "is_weight_max": 1.5, "is_weight_min": 0.7})


def test_empty_micro_batch_reports_no_extremes():
    _, metrics = rl_loss(LossConfig(), logprobs=t(-1.0, -2.0), old_logprobs=t(-1.0, -2.0), rollout_logprobs=t(0.0, 0.0),
                         advantages=t(0.0, 0.0), loss_mask=t(0, 0), seq_index=torch.tensor([0, 0]), norm=LossNorm(5, 2))
    assert metrics == {}


def test_kl_coef_without_reference_and_unknown_names_raise():
    args = dict(logprobs=t(-1.0), old_logprobs=t(-1.0), rollout_logprobs=t(-1.0), advantages=t(1.0), loss_mask=t(1),
                seq_index=torch.tensor([0]), norm=LossNorm(1, 1))
    with pytest.raises(ValueError, match="ref_logprobs"):
        rl_loss(LossConfig(kl_coef=0.1), **args)
    with pytest.raises(NoriaError, match="train.loss.policy_loss: unknown policy loss 'ppo'; valid: cispo, gspo, ppo_clip"):
        rl_loss(LossConfig(policy_loss="ppo"), **args)
    with pytest.raises(NoriaError, match="train.loss.off_policy"):
        rl_loss(LossConfig(off_policy="icepop"), **args)


def test_bf16_logprobs_give_an_fp32_loss_and_a_bf16_gradient():
    lp = t(-1.0, -0.5).to(torch.bfloat16).requires_grad_(True)
    loss, _ = rl_loss(LossConfig(), logprobs=lp, old_logprobs=t(-1.0, -0.5), rollout_logprobs=t(-1.0, -0.5),
                      advantages=t(1.0, -1.0), loss_mask=t(1, 1), seq_index=torch.tensor([0, 1]), norm=LossNorm(2, 2))
    loss.backward()
    assert loss.dtype == torch.float32 and lp.grad.dtype == torch.bfloat16
    assert lp.grad.float().tolist() == pytest.approx([-0.5, 0.5])
