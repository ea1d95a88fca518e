"""Packing: token alignment (the shift), groups of different sizes, token-budget micro-batches."""

from __future__ import annotations

import pytest
import torch

from noria.train.backend import step_totals
from noria.train.logprobs import token_logprobs
from noria.train.packing import pack_groups, pack_samples, plan_for_rank, plan_micro_batches, seq_index, slice_batch
from noria.types import Group, Prompt, Sample


def _sample(p, r, mask=None, lps=None):
    return Sample(prompt_ids=p, response_ids=r, loss_mask=mask or [1] * len(r), rollout_logprobs=lps or [-0.5] * len(r), weight_versions=[3] * len(r))


def test_fields_align_to_the_predicted_token():
    s = _sample([10, 11], [12, 13, 14], mask=[1, 0, 1], lps=[-1.0, -2.0, -3.0])
    b = pack_samples([s], [2.0])
    assert b.input_ids.tolist() == [10, 11, 12, 13, 14]
    assert b.positions.tolist() == [0, 1, 2, 3, 4]
    assert b.loss_mask.tolist() == [0, 0, 1, 0, 1]
    assert b.rollout_logprobs.tolist() == [0, 0, -1.0, 0, -3.0]
    assert b.advantages.tolist() == [0, 0, 2.0, 0, 2.0]
    assert b.weight_versions.tolist() == [-1, -1, 3, -1, 3]


def test_logprob_of_token_t_comes_from_position_t_minus_1():
    # A head that puts all mass on (hidden value + 1): position t predicts token t+1 exactly.
    vocab = 8
    ids = torch.tensor([1, 2, 3, 5, 6])  # two sequences: [1, 2, 3] and [5, 6]
    cu = torch.tensor([0, 3, 5])
    hidden = ids.float()[:, None]

    def head(h):
        return torch.nn.functional.one_hot(h[:, 0].long() + 1, vocab).float() * 50

    lp, ent = token_logprobs(hidden, head, ids, cu, chunk_tokens=2, with_entropy=True)
    assert lp[[0, 3]].tolist() == [0.0, 0.0]  # first tokens are never predicted
    assert lp[[1, 2, 4]].abs().max() < 1e-10 and ent[[1, 2, 4]].max() < 1e-10
    # Same hidden states, tokens 2 and 4 changed: only the logprobs AT those tokens drop.
    other = torch.tensor([1, 2, 4, 5, 7])
    lp_other, _ = token_logprobs(hidden, head, other, cu, chunk_tokens=4)
    assert lp_other[1].abs() < 1e-10 and (lp_other[[2, 4]] < -40).all()


def test_groups_of_different_sizes_pack_without_reshapes():
    groups = [
        Group(0, Prompt("a"), (_sample([1], [2, 3]), _sample([1], [4]))),
        Group(1, Prompt("b"), (_sample([5, 6], [7]),)),
    ]
    b = pack_groups(groups, [[1.0, -1.0], [0.5]])
    assert b.cu_seqlens.tolist() == [0, 3, 5, 8] and b.sample_ids.tolist() == [0, 1, 2]
    assert b.advantages.tolist() == [0, 1.0, 1.0, 0, -1.0, 0, 0, 0.5]
    assert seq_index(b).tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert step_totals(b) == (4.0, 3)
    with pytest.raises(ValueError, match="one entry per sample"):
        pack_groups(groups, [[1.0], [0.5]])


def test_micro_batches_respect_the_budget():
    samples = [_sample([1] * p, [2] * r) for p, r in [(2, 2), (1, 2), (3, 9), (1, 1), (2, 3)]]
    b = pack_samples(samples)  # lengths 4, 3, 12, 2, 5
    assert plan_micro_batches(b, 8) == [(0, 2), (2, 3), (3, 5)]  # 12 > 8 gets its own
    assert plan_micro_batches(b, 1) == [(i, i + 1) for i in range(5)]
    assert plan_micro_batches(b, 10_000) == [(0, 5)]
    mb = slice_batch(b, 3, 5)
    assert mb.cu_seqlens.tolist() == [0, 2, 7] and mb.n_tokens == 7


def test_rank_plans_cover_everything_once_and_have_equal_counts():
    samples = [_sample([1] * 2, [2] * n) for n in (1, 5, 2, 7, 3)]
    b = pack_samples(samples)
    plans = [plan_for_rank(b, 8, r, 2) for r in range(2)]
    assert len(plans[0].ranges) == len(plans[1].ranges)
    real = sorted(r for p in plans for r, s in zip(p.ranges, p.scales) if s)
    assert real == plan_micro_batches(b, 8)
    # More ranks than micro-batches: the idle ranks run a zero-weight copy.
    idle = plan_for_rank(pack_samples(samples[:1]), 8, 1, 2)
    assert idle.scales == [0.0]
