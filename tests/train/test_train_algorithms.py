"""RL objective parts, each against numbers worked out by hand or with plain Python loops (CPU, fast)."""

import math

import pytest
import torch

from noria.config import ConfigError, LossConfig
from noria.errors import NoriaError
from noria.train.algorithms import (
    ADVANTAGES,
    AGGREGATIONS,
    KL_ESTIMATORS,
    OFF_POLICY,
    POLICY_LOSSES,
    LossNorm,
    UnknownAlgorithmError,
    compute_advantages,
    gae,
    get_aggregation,
    get_kl,
    get_off_policy,
    get_policy_loss,
    register_kl,
)
from noria.train.algorithms.advantages import EPS


def approx(values, rel=1e-5, abs=1e-6):
    return pytest.approx(values, rel=rel, abs=abs)


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


# ---------------------------------------------------------------- advantages


def test_grpo_divides_by_unbiased_group_std():
    adv = compute_advantages(LossConfig(advantage="grpo"), [[1.0, 0.0, 0.0, 1.0], [2.0, 2.0], [5.0]])
    std = math.sqrt(4 * 0.25 / 3)
    assert adv[0] == approx([0.5 / (std + EPS), -0.5 / (std + EPS), -0.5 / (std + EPS), 0.5 / (std + EPS)])
    assert adv[1] == [0.0, 0.0]  # equal rewards: no signal
    assert adv[2] == [0.0]  # a lone sample has no baseline


def test_grpo_without_std_and_dr_grpo_only_centre():
    rewards = [[1.0, 0.0, 0.0, 1.0], [3.0, 0.0]]
    expected = [[0.5, -0.5, -0.5, 0.5], [1.5, -1.5]]
    assert compute_advantages(LossConfig(advantage="grpo", normalize_std=False), rewards) == expected
    assert compute_advantages(LossConfig(advantage="dr_grpo", normalize_std=True), rewards) == expected


def test_rloo_leave_one_out_baseline():
    adv = compute_advantages(LossConfig(advantage="rloo"), [[1.0, 0.0, 0.0, 1.0], [4.0, 1.0, 1.0], [3.0]])
    assert adv[0] == approx([1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3])
    assert adv[1] == approx([4 - 1.0, 1 - 2.5, 1 - 2.5])
    assert adv[2] == [0.0]


def test_reinforce_pp_normalises_over_the_whole_batch():
    adv = compute_advantages(LossConfig(advantage="reinforce_pp"), [[1.0, 0.0], [3.0]])
    mean = 4 / 3
    std = math.sqrt(((1 - mean) ** 2 + mean**2 + (3 - mean) ** 2) / 2)
    assert adv == [approx([(1 - mean) / (std + EPS), (0 - mean) / (std + EPS)]), approx([(3 - mean) / (std + EPS)])]


def test_reinforce_pp_baseline_centres_per_group_then_normalises_globally():
    adv = compute_advantages(LossConfig(advantage="reinforce_pp_baseline"), [[1.0, 0.0], [3.0, 5.0]])
    std = math.sqrt((0.25 + 0.25 + 1 + 1) / 3)  # centred values 0.5, -0.5, -1, 1 have mean 0
    assert adv == [approx([0.5 / (std + EPS), -0.5 / (std + EPS)]), approx([-1 / (std + EPS), 1 / (std + EPS)])]


def test_unknown_advantage_lists_valid_names_and_gae_points_to_the_function():
    with pytest.raises(NoriaError, match="train.loss.advantage.*valid: dr_grpo, grpo, reinforce_pp, reinforce_pp_baseline, rloo"):
        compute_advantages(LossConfig(advantage="ppo"), [[1.0]])
    with pytest.raises(UnknownAlgorithmError, match="critic.*noria.train.critic.ppo_train.*noria.train.algorithms.gae"):
        compute_advantages(LossConfig(advantage="gae"), [[1.0]])


def test_gae_terminal_values():
    rewards, values, mask = t(0.0, 0.0, 1.0), t(0.5, 0.6, 0.7), t(1, 1, 1)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert adv.tolist() == approx([0.5, 0.4, 0.3])  # Monte-Carlo return 1 minus V
    assert ret.tolist() == approx([1.0, 1.0, 1.0])
    gamma, lam = 0.9, 0.8
    expected, running, next_v = [0.0] * 3, 0.0, 0.0
    for i in reversed(range(3)):
        delta = rewards[i].item() + gamma * next_v - values[i].item()
        running = delta + gamma * lam * running
        expected[i], next_v = running, values[i].item()
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    assert adv.tolist() == approx(expected)
    assert ret.tolist() == approx([a + v for a, v in zip(expected, values.tolist())])


def test_gae_bootstraps_and_skips_masked_tokens():
    adv, ret = gae(t(0.0, 0.0, 1.0), t(0.5, 0.6, 0.7, 2.0), t(1, 1, 1), gamma=1.0, lam=1.0)
    assert adv.tolist() == approx([2.5, 2.4, 2.3]) and ret.tolist() == approx([3.0, 3.0, 3.0])
    # token 1 is tool output: its reward 5 and value 9 are ignored, token 0 looks straight at token 2
    adv, ret = gae(t(0.0, 5.0, 1.0), t(0.5, 9.0, 0.7), t(1, 0, 1), gamma=0.9, lam=0.8)
    a2 = 1.0 - 0.7
    a0 = (0.9 * 0.7 - 0.5) + 0.9 * 0.8 * a2
    assert adv.tolist() == approx([a0, 0.0, a2]) and ret.tolist() == approx([a0 + 0.5, 0.0, 1.0])
    batched, _ = gae(torch.stack([t(0.0, 0.0, 1.0), t(0.0, 5.0, 1.0)]), torch.stack([t(0.5, 0.6, 0.7), t(0.5, 9.0, 0.7)]),
                     torch.stack([t(1, 1, 1), t(1, 0, 1)]), gamma=0.9, lam=0.8)
    assert batched[1].tolist() == approx([a0, 0.0, a2])
    with pytest.raises(ValueError, match="T or T\\+1"):
        gae(t(0.0, 1.0), t(0.1, 0.2, 0.3, 0.4), t(1, 1), 1.0, 1.0)


# ---------------------------------------------------------------- KL estimators


LP, REF = [-1.0, -2.0, -0.5, -0.1], [-1.5, -1.0, -0.5, -0.3]


@pytest.mark.parametrize(
    "name, formula",
    [
        ("k1", lambda lp, ref: lp - ref),
        ("k2", lambda lp, ref: 0.5 * (lp - ref) ** 2),
        ("k3", lambda lp, ref: math.exp(ref - lp) - (ref - lp) - 1),
        ("low_var_kl", lambda lp, ref: math.exp(ref - lp) - (ref - lp) - 1),
    ],
)
def test_kl_estimators(name, formula):
    assert get_kl(name)(t(*LP), t(*REF)).tolist() == approx([formula(a, b) for a, b in zip(LP, REF)])


def test_low_var_kl_is_clamped_like_verl():
    out = get_kl("low_var_kl")(t(0.0, 0.0, 0.0), t(30.0, -30.0, 2.5))
    assert out.tolist() == approx([10.0, 10.0, min(math.exp(2.5) - 2.5 - 1, 10.0)])
    assert get_kl("k3")(t(0.0), t(30.0)).item() > 1e12  # the unclamped estimator is not


# ---------------------------------------------------------------- policy losses


def _policy(name, cfg, lp, old, adv, mask=None, seq=None):
    lp = lp.clone().requires_grad_(True)
    n = lp.shape[0]
    mask = torch.ones(n, dtype=torch.bool) if mask is None else mask
    seq = torch.zeros(n, dtype=torch.long) if seq is None else seq
    loss, stats = get_policy_loss(name)(cfg, lp, old, adv, mask, seq)
    loss.sum().backward()
    return loss.detach(), lp.grad, stats


def test_ppo_clip_values_gradients_and_clip_fraction():
    ratios = [1.5, 0.5, 0.5, 1.5, 1.1, 0.95]
    advs = [1.0, 1.0, -1.0, -1.0, 2.0, -3.0]
    cfg = LossConfig(clip_low=0.2, clip_high=0.28)
    loss, grad, stats = _policy("ppo_clip", cfg, t(*[math.log(r) for r in ratios]), torch.zeros(6), t(*advs))
    # token 0: A>0 above 1.28 -> clipped; 2: A<0 below 0.8 -> clipped; the rest follow the ratio
    assert loss.tolist() == approx([-1.28, -0.5, 0.8, 1.5, -2.2, 2.85])
    assert grad.tolist() == approx([0.0, -0.5, 0.0, 1.5, -2.2, 2.85])  # d(-A r)/dlp = -A r
    assert stats["clip_frac"].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def test_dual_clip_bounds_negative_advantage_losses():
    ratios = [5.0, 2.0, 5.0, 0.1]
    advs = [-1.0, -1.0, 1.0, -2.0]
    lp = t(*[math.log(r) for r in ratios])
    loss, grad, stats = _policy("ppo_clip", LossConfig(dual_clip=3.0), lp, torch.zeros(4), t(*advs))
    assert loss.tolist() == approx([3.0, 2.0, -1.28, 1.6])
    assert grad.tolist() == approx([0.0, 2.0, 0.0, 0.0])
    assert stats["dual_clip_frac"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert stats["clip_frac"].tolist() == [1.0, 0.0, 1.0, 1.0]
    plain, _, _ = _policy("ppo_clip", LossConfig(), lp, torch.zeros(4), t(*advs))
    assert plain[0].item() == approx(5.0)
    gen = torch.Generator().manual_seed(0)
    lp, adv = torch.randn(256, generator=gen) * 3, torch.randn(256, generator=gen)
    loss, _, _ = _policy("ppo_clip", LossConfig(dual_clip=3.0), lp, torch.zeros(256), adv)
    assert bool((loss <= 3.0 * adv.abs() + 1e-6).all())


def test_gspo_gradient_equals_the_sequence_objective():
    cfg = LossConfig(policy_loss="gspo", aggregation="seq_mean_token_mean", clip_low=0.05, clip_high=0.05)
    gen = torch.Generator().manual_seed(1)
    lengths, seq_adv = [3, 4, 2, 5], [1.0, -0.7, 2.0, -1.5]
    seq = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    old = -torch.rand(14, generator=gen) * 2
    lp0 = old + torch.randn(14, generator=gen) * 0.05
    lp0[7:9] = old[7:9] + 0.2  # sequence 2's ratio exp(0.2) is far outside the clip range
    mask = torch.ones(14, dtype=torch.bool)
    adv = torch.tensor(seq_adv)[seq]

    lp = lp0.clone().requires_grad_(True)
    per_token, stats = get_policy_loss("gspo")(cfg, lp, old, adv, mask, seq)
    get_aggregation(cfg.aggregation)(cfg, per_token, mask, seq, LossNorm(14, 4)).backward()

    ref = lp0.clone().requires_grad_(True)
    objective, start, clipped = 0.0, 0, []
    for length, a in zip(lengths, seq_adv):
        s = torch.exp((ref[start : start + length] - old[start : start + length]).mean())
        objective = objective + torch.maximum(-a * s, -a * torch.clamp(s, 0.95, 1.05)) / 4
        clipped += [float(bool(-a * torch.clamp(s, 0.95, 1.05) > -a * s))] * length
        start += length
    objective.backward()
    assert lp.grad.tolist() == approx(ref.grad.tolist(), rel=1e-5)
    assert stats["clip_frac"].tolist() == clipped and 0 < sum(clipped) < 14
    assert lp.grad[7:9].abs().max().item() == 0.0


def test_gspo_sequence_ratio_ignores_masked_tokens():
    cfg = LossConfig(clip_low=10.0, clip_high=10.0)
    lp, old = t(-1.0, -2.0, -0.5), t(-1.2, -1.0, -0.4)
    mask = torch.tensor([True, False, True])
    loss, _, _ = _policy("gspo", cfg, lp, old, t(1.0, 1.0, 1.0), mask=mask)
    s = math.exp(((-1.0 + 1.2) + (-0.5 + 0.4)) / 2)
    assert loss[0].item() == approx(-s) and loss[2].item() == approx(-s)


def test_cispo_keeps_a_clipped_stop_gradient_weight():
    ratios, advs = [1.5, 0.5, 1.1], [1.0, -2.0, 0.5]
    old = t(-1.0, -2.0, -0.3)
    lp = old + t(*[math.log(r) for r in ratios])
    loss, grad, stats = _policy("cispo", LossConfig(clip_low=0.2, clip_high=0.28), lp, old, t(*advs))
    weights = [1.28, 0.8, 1.1]
    assert loss.tolist() == approx([-w * a * x for w, a, x in zip(weights, advs, lp.tolist())])
    assert grad.tolist() == approx([-w * a for w, a in zip(weights, advs)])  # clipped tokens keep a gradient
    assert stats["clip_frac"].tolist() == [1.0, 1.0, 0.0]


# ---------------------------------------------------------------- off-policy corrections


def _correct(name, cfg, old, rollout, mask=None, seq=None):
    n = old.shape[0]
    mask = torch.ones(n, dtype=torch.bool) if mask is None else mask
    seq = torch.zeros(n, dtype=torch.long) if seq is None else seq
    return get_off_policy(name)(cfg, old, rollout, mask, seq)


def test_tis_caps_the_token_weight():
    w, keep = _correct("tis", LossConfig(is_cap=2.0), t(-1.0, -0.5, -3.0, -0.2), t(-1.3, -2.0, -2.0, -0.2))
    assert w.tolist() == approx([math.exp(0.3), 2.0, math.exp(-1.0), 1.0])
    assert keep.all()


def test_mis_masks_tokens_outside_the_band():
    old, rollout = t(-1.0, -0.5, -3.0, -0.2, -1.0), t(-1.3, -2.0, -2.0, -0.2, -0.4)
    w, keep = _correct("mis", LossConfig(mis_low=0.5, mis_high=2.0), old, rollout)
    # ratios: e^0.3 = 1.35 kept, e^1.5 = 4.48 masked, e^-1 = 0.37 masked, 1 kept, e^-0.6 = 0.55 kept
    assert keep.tolist() == [True, False, False, True, True]
    assert w.tolist() == approx([math.exp(0.3), 0.0, 0.0, 1.0, math.exp(-0.6)])


def test_seq_is_uses_the_sum_over_each_sequence_and_caps_it():
    old = t(-1.0, -0.5, -9.0, -0.2, -0.1, -0.4)
    rollout = t(-1.1, -0.7, -0.0, -0.2, -0.6, -0.5)
    mask = torch.tensor([True, True, False, True, True, True])  # token 2 (not trained) must not count
    seq = torch.tensor([0, 0, 0, 1, 2, 2])
    w, keep = _correct("seq_is", LossConfig(is_cap=1.5), old, rollout, mask, seq)
    s0, s1, s2 = math.exp(0.1 + 0.2), 1.0, min(math.exp(0.5 + 0.1), 1.5)
    assert w.tolist() == approx([s0, s0, s0, s1, s2, s2]) and keep.all()


def test_no_correction_is_one():
    w, keep = _correct("none", LossConfig(), t(-1.0, -2.0), t(-3.0, 0.0))
    assert w.tolist() == [1.0, 1.0] and keep.all()


# ---------------------------------------------------------------- aggregations


VALUES = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
MASK = [True, True, False, True, True, True]
SEQ = [0, 0, 0, 1, 2, 2]


def _agg(name, cfg, norm):
    return get_aggregation(name)(cfg, t(*VALUES), torch.tensor(MASK), torch.tensor(SEQ), norm).item()


def test_token_mean_divides_by_step_tokens():
    kept = [v for v, m in zip(VALUES, MASK) if m]
    assert _agg("token_mean", LossConfig(), LossNorm(total_tokens=20, total_seqs=7)) == approx(sum(kept) / 20)


def test_seq_mean_token_mean_divides_by_step_sequences():
    per_seq = {}
    for v, m, s in zip(VALUES, MASK, SEQ):
        if m:
            per_seq.setdefault(s, []).append(v)
    expected = sum(sum(vs) / len(vs) for vs in per_seq.values()) / 7
    assert _agg("seq_mean_token_mean", LossConfig(), LossNorm(total_tokens=20, total_seqs=7)) == approx(expected)


def test_seq_mean_token_sum_with_and_without_the_dr_grpo_divisor():
    total = sum(v for v, m in zip(VALUES, MASK) if m)
    norm = LossNorm(total_tokens=20, total_seqs=7)
    assert _agg("seq_mean_token_sum", LossConfig(), norm) == approx(total / 7)
    assert _agg("seq_mean_token_sum", LossConfig(seq_sum_divisor=64.0), norm) == approx(total / (7 * 64))


def test_loss_norm_counts_trained_tokens_and_sequences_with_any():
    masks = [t(0, 1, 1, 0, 0, 1), t(0, 0, 0, 1)]
    seqs = [torch.tensor([0, 0, 0, 1, 1, 2]), torch.tensor([0, 0, 1, 1])]
    assert LossNorm.from_masks(masks, seqs) == LossNorm(total_tokens=4.0, total_seqs=3.0)  # seq 1 of mb 0 and seq 0 of mb 1 have none
    assert get_aggregation("token_mean")(LossConfig(), t(1.0), torch.tensor([False]), torch.tensor([0]), LossNorm(0, 0)).item() == 0.0


# ---------------------------------------------------------------- registries


@pytest.mark.parametrize(
    "getter, table, field",
    [
        (get_policy_loss, POLICY_LOSSES, "policy_loss"),
        (get_kl, KL_ESTIMATORS, "kl_estimator"),
        (get_aggregation, AGGREGATIONS, "aggregation"),
        (get_off_policy, OFF_POLICY, "off_policy"),
    ],
)
def test_unknown_names_raise_with_the_valid_ones(getter, table, field):
    with pytest.raises(NoriaError, match=f"train.loss.{field}: unknown .* 'nope'; valid: {', '.join(sorted(table))}"):
        getter("nope")


def test_registries_hold_the_documented_names():
    assert set(ADVANTAGES) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"}
    assert set(POLICY_LOSSES) == {"ppo_clip", "gspo", "cispo"}
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3", "low_var_kl"}
    assert set(AGGREGATIONS) == {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum"}
    assert set(OFF_POLICY) == {"none", "tis", "mis", "seq_is", "recompute"}


def test_registering_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register_kl("k3")(lambda lp, ref: lp)
    assert KL_ESTIMATORS["k3"].__name__ == "k3"


def test_seq_sum_divisor_is_validated():
    with pytest.raises(ConfigError, match="seq_sum_divisor"):
        LossConfig(seq_sum_divisor=0.0).validate()
    LossConfig(seq_sum_divisor=1024.0).validate()
