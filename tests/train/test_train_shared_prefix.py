"""Shared prompts (the prefix tree's simplest case): a group's prompt goes through the trainer once,
with the same results."""

from __future__ import annotations

import torch

from noria.config import TrainConfig
from noria.train.fsdp import FSDPBackend
from noria.train.packing import pack_samples, prediction_sources, seq_index, slice_batch
from noria.train.prefix_tree import packed_trees, share_prefixes
from noria.types import Sample
from train_util import grouped_samples, make_backend, record_grads


def test_share_prefixes_layout_and_sources():
    samples = grouped_samples()
    batch = pack_samples(samples, torch.linspace(-1, 1, len(samples)).tolist())
    shared, keep, index = share_prefixes(batch)
    # groups 0 and 1 share their prompt; group 2's 3-token prompt is too short, group 3 has one sample
    trees = packed_trees(shared.cu_seqlens, shared.parents)
    assert [t is not None for t in trees] == [True, True, False, False, False]
    # [prompt, rest_1, rest_2, ...]: every later rest hangs below the prompt's last token
    assert [[p for i, p in enumerate(t) if i and p != i - 1] for t in trees[:2]] == [[11, 11, 11], [8, 8]]
    assert shared.n_tokens == batch.n_tokens - 3 * 12 - 2 * 9
    for name in ("input_ids", "positions", "loss_mask", "advantages", "rollout_logprobs"):
        assert torch.equal(getattr(shared, name)[index], getattr(batch, name)), name
        assert torch.equal(getattr(batch, name)[keep], getattr(shared, name)), name
    assert torch.equal(keep[index[keep]], keep)  # kept tokens map to themselves
    # every token is predicted from a token with the same id and position as before
    src0, dst0 = prediction_sources(batch.cu_seqlens, batch.positions)
    src1, dst1 = prediction_sources(shared.cu_seqlens, shared.positions, shared.parents)
    pred = dict(zip(dst1.tolist(), src1.tolist()))
    trained = batch.loss_mask > 0
    for s, d in zip(src0.tolist(), dst0.tolist()):
        if not trained[d]:
            continue
        assert int(index[d]) in pred, d
        got = pred[int(index[d])]
        assert shared.input_ids[got] == batch.input_ids[s] and shared.positions[got] == batch.positions[s]
    # the loss still sees one sequence per sample, and slices keep that numbering dense
    assert seq_index(shared).max().item() == len(samples) - 1
    part = slice_batch(shared, 1, 3)
    assert seq_index(part).tolist()[0] == 0 and seq_index(part).max().item() == 3  # group 1 (3 samples) + one plain sequence


def test_nothing_shared_when_the_common_start_is_trained_or_short():
    a = Sample(prompt_ids=[], response_ids=list(range(5, 25)), loss_mask=[1] * 20)
    b = Sample(prompt_ids=[], response_ids=list(range(5, 25)) + [7], loss_mask=[1] * 21)
    c = Sample(prompt_ids=[4] * 7, response_ids=[9], loss_mask=[1])
    d = Sample(prompt_ids=[4] * 7, response_ids=[8], loss_mask=[1])
    for samples in ([a, b], [c, d]):
        batch = pack_samples(samples)
        shared, keep, index = share_prefixes(batch)
        assert shared is batch and torch.equal(keep, index)


def test_shared_and_plain_packing_train_the_same(tiny_model_dir):
    """fp32: logprobs, losses and the updated weights agree with sharing on and off (the reference
    model's KL and a sequence-level aggregation included)."""
    samples = grouped_samples(groups=((12, 4), (9, 3), (5, 1)), vocab=200)
    batch = pack_samples(samples, torch.linspace(-1, 1, len(samples)).tolist())
    loss = {"aggregation": "seq_mean_token_mean", "kl_coef": 0.1}
    # micro-batches of 40 tokens: the shared groups are cut from the rest differently than the plain ones
    plain = make_backend(tiny_model_dir, loss_fn=None, share_prefix=False, micro_batch_tokens=40, loss=loss)
    shared = make_backend(tiny_model_dir, loss_fn=None, share_prefix=True, micro_batch_tokens=40, loss=loss)
    lp_plain, lp_shared = plain.compute_logprobs(batch, with_entropy=True), shared.compute_logprobs(batch, with_entropy=True)
    torch.testing.assert_close(lp_shared.logprobs, lp_plain.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp_shared.entropy, lp_plain.entropy, atol=1e-5, rtol=1e-5)
    trained = shared.compute_logprobs(batch, trained_only=True).logprobs
    mask = batch.loss_mask > 0
    assert torch.equal(trained[~mask], torch.zeros(int((~mask).sum())))
    torch.testing.assert_close(trained[mask], lp_plain.logprobs[mask], atol=1e-5, rtol=1e-5)
    old = lp_plain.logprobs - 0.05  # off-policy: ratios != 1, so clipping statistics mean something
    grads_plain, grads_shared = record_grads(plain), record_grads(shared)
    m_plain, m_shared = plain.train_step(batch, old_logprobs=old), shared.train_step(batch, old_logprobs=old)
    for key in ("loss", "grad_norm", "ref_kl", "clip_frac", "approx_kl", "rollout_logprob_abs_diff"):
        assert abs(m_plain[key] - m_shared[key]) < 1e-5 * max(1.0, abs(m_plain[key])), key
    assert m_plain["tokens"] == m_shared["tokens"] == batch.n_tokens
    assert grads_plain.keys() == grads_shared.keys() and len(grads_plain) > 5
    for name, g in grads_plain.items():
        torch.testing.assert_close(grads_shared[name], g, atol=1e-6, rtol=1e-4)


def test_shared_prefix_is_bitwise_in_deterministic_mode(tiny_model_dir):
    samples = grouped_samples(groups=((70, 3), (9, 2)), vocab=200, seed=3)
    batch = pack_samples(samples)

    def backend(share: bool) -> FSDPBackend:
        b = FSDPBackend(TrainConfig(param_dtype="bfloat16", share_prefix=share, logprob_chunk_tokens=16), deterministic=True)
        b.init(tiny_model_dir)
        return b

    mask = batch.loss_mask > 0
    got = backend(True).compute_logprobs(batch).logprobs[mask]
    want = backend(False).compute_logprobs(batch).logprobs[mask]
    assert torch.equal(got, want)
