"""Prefix-tree training: tokens several sequences share (a group's prompt, a common start of two
responses, a first turn of two episodes) go through the trainer once, with the unshared results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from noria.config import TrainConfig
from noria.models.attention import TreeLayout, exact_tree_attention, tree_attention
from noria.train.fsdp import FSDPBackend
from noria.train.packing import pack_samples, prediction_sources
from noria.train.prefix_tree import packed_trees, share_prefixes
from noria.types import Sample
from train_util import make_backend, record_grads


def tree_samples(seed: int = 0) -> list[Sample]:
    """Seven samples, the sharers not next to each other: three of a group (prompt PA; the first two
    share 4 trained response tokens), an episode's later turn as a sample of its own (its first turn,
    a tool answer and the prompt as its prompt: untrained here), two episodes sharing that first
    turn (trained there) before different second turns, and one sequence sharing nothing. Every
    sample has its own advantage and rollout logprobs."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int, lo: int = 3, hi: int = 150) -> list[int]:
        return torch.randint(lo, hi, (n,), generator=g).tolist()

    pa, pm, turn, tool = ids(12), ids(10), ids(5), ids(4)
    ra = ids(6)
    specs = [  # (prompt, response, loss mask)
        (pa, ra, [1] * 6),
        (pm + turn + tool, ids(6), [1] * 6),
        (pm, turn + tool + ids(4), [1] * 5 + [0] * 4 + [1] * 4),
        (pa, ra[:4] + ids(5), [1] * 9),
        (pm, turn + tool + ids(3), [1] * 5 + [0] * 4 + [1] * 3),
        (pa, ids(7), [1, 1, 0, 1, 1, 1, 1]),
        (ids(9, 150, 190), ids(4, 150, 190), [1] * 4),
    ]
    out = []
    for i, (prompt, response, mask) in enumerate(specs):
        r = len(response)
        out.append(Sample(
            prompt_ids=prompt, response_ids=response, loss_mask=mask,
            rollout_logprobs=(-torch.rand(r, generator=g) * 4).tolist(), weight_versions=[i % 2] * r, index=i,
        ))
    return out


def distinct_prefixes(batch) -> int:
    """Nodes of the batch's token trie: distinct (sequence prefix) tuples."""
    cu, ids = batch.cu_seqlens.tolist(), batch.input_ids.tolist()
    return len({tuple(ids[a : t + 1]) for a, b in zip(cu[:-1], cu[1:]) for t in range(a, b)})


def test_the_tree_holds_each_distinct_prefix_once_and_maps_every_token_back():
    samples = tree_samples()
    batch = pack_samples(samples, torch.linspace(-1, 1, len(samples)).tolist())
    tree, keep, index = share_prefixes(batch, trained=True)
    assert tree.n_tokens == distinct_prefixes(batch) < batch.n_tokens
    for name in ("input_ids", "positions"):
        assert torch.equal(getattr(tree, name)[index], getattr(batch, name)), name
    assert torch.equal(index[keep], torch.arange(tree.n_tokens))
    # a node is trained where any sequence through it is (the first turn: trained in the episodes only)
    assert torch.equal(tree.loss_mask, torch.zeros(tree.n_tokens).scatter_reduce(0, index, batch.loss_mask, "amax"))
    # every token is predicted from the node of the token before it in its own sequence
    src0, dst0 = prediction_sources(batch.cu_seqlens, batch.positions)
    src1, dst1 = prediction_sources(tree.cu_seqlens, tree.positions, tree.parents)
    pred = dict(zip(dst1.tolist(), src1.tolist()))
    assert all(pred[int(index[d])] == int(index[s]) for s, d in zip(src0.tolist(), dst0.tolist()))
    # without trained sharing only the untrained prompts are shared; the partial response is not
    untrained, _, _ = share_prefixes(batch)
    assert tree.n_tokens < untrained.n_tokens < batch.n_tokens


def test_nothing_to_share_comes_back_unchanged():
    g = torch.Generator().manual_seed(1)
    samples = [Sample(prompt_ids=[k] + torch.randint(3, 100, (9,), generator=g).tolist(), response_ids=[5, 6], loss_mask=[1, 1])
               for k in (3, 4, 5)]
    # the last two share 7 tokens: fewer than MIN_SHARED_PREFIX (8), not worth a tree
    samples.append(Sample(prompt_ids=samples[-1].prompt_ids[:7] + [120, 121], response_ids=[5], loss_mask=[1]))
    batch = pack_samples(samples)
    tree, keep, index = share_prefixes(batch, trained=True)
    assert tree is batch and torch.equal(keep, torch.arange(batch.n_tokens)) and torch.equal(index, keep)


def test_trees_are_capped():
    samples = tree_samples()
    batch = pack_samples(samples)
    tree, _, index = share_prefixes(batch, max_tokens=40, trained=True)
    lens = torch.diff(tree.cu_seqlens).tolist()
    assert max(lens) <= 40 and tree.n_tokens < batch.n_tokens
    assert torch.equal(tree.input_ids[index], batch.input_ids)


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """Bool [L, L]: token i sees j when j is i or one of its ancestors (the definition, densely)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def test_tree_attention_is_sdpa_under_the_ancestor_mask():
    parents = [-1, 0, 1, 2, 3, 2, 5, 6, 1, 8, 6, 10]  # branches below tokens 2, 1 and 6
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, len(parents), h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    tree = TreeLayout(parents)
    assert tree.depths == [0, 1, 2, 3, 4, 3, 4, 5, 2, 3, 5, 6]
    mask = ancestor_mask(parents)

    def dense(q, k, v):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out, want = tree_attention(*leaves, tree), dense(*ref)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (out * w).sum().backward()
    (want * w).sum().backward()
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    exact = exact_tree_attention(q.float(), k.float(), v.float(), tree)
    torch.testing.assert_close(exact, want.float(), rtol=1e-5, atol=1e-6)


def test_tree_and_plain_packing_train_the_same(tiny_model_dir):
    """fp32: every per-token logprob and entropy, the loss and its metrics, and the gradient of every
    parameter agree with the tree on and off (sequence-level aggregation, KL to the reference and an
    entropy bonus included; micro-batches of 48 tokens cut the two packings differently)."""
    samples = tree_samples()
    batch = pack_samples(samples, torch.linspace(-1, 1, len(samples)).tolist())
    loss = {"aggregation": "seq_mean_token_mean", "kl_coef": 0.1, "entropy_coef": 0.01}
    plain = make_backend(tiny_model_dir, loss_fn=None, share_prefix=False, micro_batch_tokens=48, loss=loss)
    tree = make_backend(tiny_model_dir, loss_fn=None, share_prefix=True, micro_batch_tokens=48, loss=loss)
    lp_plain, lp_tree = plain.compute_logprobs(batch, with_entropy=True), tree.compute_logprobs(batch, with_entropy=True)
    torch.testing.assert_close(lp_tree.logprobs, lp_plain.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp_tree.entropy, lp_plain.entropy, atol=1e-5, rtol=1e-5)
    # off-policy, differently per token: a shared trained token's ratio differs between its sequences
    old = lp_plain.logprobs - 0.05 * torch.rand(batch.n_tokens, generator=torch.Generator().manual_seed(2))
    grads_plain, grads_tree = record_grads(plain), record_grads(tree)
    m_plain, m_tree = plain.train_step(batch, old_logprobs=old), tree.train_step(batch, old_logprobs=old)
    for key in ("loss", "grad_norm", "ref_kl", "entropy", "clip_frac", "approx_kl", "rollout_logprob_abs_diff", "loss_tokens"):
        assert abs(m_plain[key] - m_tree[key]) <= 1e-5 * max(1.0, abs(m_plain[key])), key
    assert m_plain["tokens"] == m_tree["tokens"] == batch.n_tokens
    assert grads_plain.keys() == grads_tree.keys() and len(grads_plain) == len(list(plain.policy.parameters()))
    for name, g in grads_plain.items():
        torch.testing.assert_close(grads_tree[name], g, atol=1e-6, rtol=1e-4)


def test_tree_is_bitwise_in_deterministic_mode(tiny_model_dir):
    batch = pack_samples(tree_samples(seed=3))

    def backend(share: bool) -> FSDPBackend:
        b = FSDPBackend(TrainConfig(param_dtype="bfloat16", share_prefix=share, logprob_chunk_tokens=16), deterministic=True)
        b.init(tiny_model_dir)
        return b

    tree, _, _ = share_prefixes(batch, trained=True)
    assert any(t is not None for t in packed_trees(tree.cu_seqlens, tree.parents))
    got = backend(True).compute_logprobs(batch).logprobs
    want = backend(False).compute_logprobs(batch).logprobs
    assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tree_on_cuda(tiny_model_dir):
    """On the GPU: the tree's logprobs and step match the plain packing's (fp32), and in deterministic
    mode (the engine's fixed-order CUDA kernel) its logprobs are bitwise the plain ones."""
    samples = tree_samples()
    batch = pack_samples(samples, torch.linspace(-1, 1, len(samples)).tolist())
    plain = make_backend(tiny_model_dir, loss_fn=None, device="cuda", share_prefix=False, micro_batch_tokens=48)
    tree = make_backend(tiny_model_dir, loss_fn=None, device="cuda", share_prefix=True, micro_batch_tokens=48)
    torch.testing.assert_close(tree.compute_logprobs(batch).logprobs, plain.compute_logprobs(batch).logprobs, atol=1e-4, rtol=1e-4)
    m_plain, m_tree = plain.train_step(batch), tree.train_step(batch)
    assert abs(m_plain["loss"] - m_tree["loss"]) < 1e-4 and abs(m_plain["grad_norm"] - m_tree["grad_norm"]) < 1e-3

    def exact(share: bool) -> torch.Tensor:
        b = FSDPBackend(TrainConfig(param_dtype="bfloat16", share_prefix=share, device="cuda"), deterministic=True)
        b.init(tiny_model_dir)
        return b.compute_logprobs(batch).logprobs

    assert torch.equal(exact(True), exact(False))
