"""Many adapters on one base in one forward (``noria.service.step.run_calls``), and the scheduler's
turns (``noria.service.scheduler``), in process on the tiny model."""

from __future__ import annotations

import pytest
import torch

from noria.config import ServiceSection
from noria.service.adapters import ATTN, MLP, AdapterSpec, MultiLora
from noria.service.client import datum
from noria.service.scheduler import Scheduler
from noria.service.step import Call, NonFiniteStep, micro_batches, run_calls
from noria.service.tenants import Tenant, load_tenants
from noria.service.wire import read_data


def two_adapters(lora: MultiLora) -> MultiLora:
    for name, seed, targets in (("a", 1, ATTN + MLP), ("b", 2, ATTN)):
        adapter = lora.add(name, name, AdapterSpec(rank=4, alpha=8.0, target_modules=targets, seed=seed))
        with torch.no_grad():  # B starts at 0 (the base model): give both adapters a distinct, non-zero update
            for n, p in adapter.params.items():
                if ".lora_B." in n:
                    p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(seed))
    return lora


@pytest.fixture(scope="module")
def lora(tiny_model_dir):
    return two_adapters(MultiLora.load(str(tiny_model_dir), "float32", "cpu"))


DATA_A = read_data([datum([5, 6, 7, 8], [6, 7, 8, 9]), datum([9, 10], [10, 11])], 512, ())
DATA_B = read_data([datum([20, 21, 22, 23, 24, 25, 26], [30] * 7, weights=[0, 0, 1, 1, 1, 1, 1])], 512, ())


def grads(adapter) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in adapter.params.items() if p.grad is not None}
    for p in adapter.params.values():
        p.grad = None
    adapter.grad_calls = 0
    return out


def test_a_mixed_batch_gives_each_adapter_what_it_gets_alone(lora):
    a, b = lora.adapters["a"], lora.adapters["b"]
    alone = {}
    for adapter, data in ((a, DATA_A), (b, DATA_B)):
        [(out, err)] = run_calls(lora, [Call(adapter, data, "cross_entropy", {}, True)])
        assert err is None
        alone[adapter.name] = (out, grads(adapter))
    mixed = run_calls(lora, [Call(a, DATA_A, "cross_entropy", {}, True), Call(b, DATA_B, "cross_entropy", {}, True)])
    for adapter, (out, err) in zip((a, b), mixed):
        want, want_grads = alone[adapter.name]
        assert err is None
        for got_row, want_row in zip(out["loss_fn_outputs"], want["loss_fn_outputs"]):
            torch.testing.assert_close(torch.tensor(got_row["logprobs"]["data"]), torch.tensor(want_row["logprobs"]["data"]), atol=1e-5, rtol=0)
        assert out["metrics"]["loss:sum"] == pytest.approx(want["metrics"]["loss:sum"], rel=1e-5)
        got_grads = grads(adapter)
        assert got_grads.keys() == want_grads.keys() and len(got_grads) == len(adapter.params)
        for n in want_grads:
            torch.testing.assert_close(got_grads[n], want_grads[n], atol=1e-5, rtol=1e-4)
    # the adapters differ, so a row's logprobs are its own adapter's
    [(base_b, _)] = run_calls(lora, [Call(a, DATA_B, "cross_entropy", {}, False)])
    assert base_b["loss_fn_outputs"][0]["logprobs"]["data"] != alone["b"][0]["loss_fn_outputs"][0]["logprobs"]["data"]


@pytest.mark.parametrize(("checkpointing", "chunk_tokens"), [(True, None), (False, 3), (True, 3)])
def test_checkpointed_layers_and_chunked_logits_give_the_same_logprobs_and_gradients(lora, tiny_model_dir, checkpointing, chunk_tokens):
    """``service.activation_checkpointing`` and ``service.logprob_chunk_tokens``: a mixed batch in
    micro-batches, its layers (and logit chunks) recomputed in backward with each row's adapter, gives
    what the kept activations give: bit for bit with whole logits, within float rounding in chunks
    (the head's matmul runs on fewer rows)."""
    other = two_adapters(MultiLora.load(str(tiny_model_dir), "float32", "cpu", checkpointing=checkpointing, chunk_tokens=chunk_tokens))
    results = []
    for multi in (lora, other):
        calls = [Call(multi.adapters["a"], DATA_A, "cross_entropy", {}, True), Call(multi.adapters["b"], DATA_B, "cross_entropy", {}, True)]
        outs = run_calls(multi, calls, micro_batch_tokens=8)
        assert all(err is None for _, err in outs)
        logprobs = [torch.tensor([x for row in o["loss_fn_outputs"] for x in row["logprobs"]["data"]]) for o, _ in outs]
        results.append((logprobs, [grads(multi.adapters[n]) for n in ("a", "b")]))
    (want_lp, want_grads), (got_lp, got_grads) = results
    tol = {"atol": 0.0, "rtol": 0.0} if chunk_tokens is None else {"atol": 1e-5, "rtol": 1e-5}
    for want, got in zip(want_lp, got_lp):
        torch.testing.assert_close(got, want, **tol)
    for want, got in zip(want_grads, got_grads):
        assert want.keys() == got.keys() and want
        for n in want:
            torch.testing.assert_close(got[n], want[n], **tol)


def test_micro_batches_give_each_call_the_loss_gradient_and_logprobs_of_one_forward(lora):
    """Calls run in micro-batches of a few tokens (a call cut between them included) get what one
    forward of everything gives: a loss's sum and its gradient add up over micro-batches."""
    assert micro_batches([4, 2, 7], 8) == [(0, 2), (2, 3)]  # 2 rows x 4; then 7 alone
    assert micro_batches([9, 3, 3], 8) == [(0, 1), (1, 3)] and micro_batches([], 8) == []
    a, b = lora.adapters["a"], lora.adapters["b"]
    ppo = read_data([datum([5, 6, 7], [6, 7, 8], logprobs=[-2.0, -2.5, -3.0], advantages=[1.0] * 3),
                     datum([8, 9, 10, 11], [9, 10, 11, 12], logprobs=[-2.2] * 4, advantages=[-0.5] * 4)],
                    512, ("logprobs", "advantages"))  # fmt: skip

    def both(budget: int):
        out = run_calls(lora, [Call(a, ppo, "ppo", {}, True), Call(b, DATA_A, "cross_entropy", {}, True)], budget)
        return [(o, grads(adapter)) for (o, err), adapter in zip(out, (a, b)) if err is None]

    whole, split = both(10_000), both(4)  # 4: every row in a micro-batch of its own
    assert len(whole) == len(split) == 2
    for (want, want_grads), (got, got_grads) in zip(whole, split):
        for got_row, want_row in zip(got["loss_fn_outputs"], want["loss_fn_outputs"], strict=True):
            torch.testing.assert_close(torch.tensor(got_row["logprobs"]["data"]), torch.tensor(want_row["logprobs"]["data"]), atol=1e-5, rtol=0)
        assert got["metrics"].keys() == want["metrics"].keys()
        for key in want["metrics"]:
            assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-4, abs=1e-6), key
        for n in want_grads:
            torch.testing.assert_close(got_grads[n], want_grads[n], atol=1e-5, rtol=1e-4)


def test_a_nonfinite_loss_in_a_mixed_batch_leaves_the_other_adapters_gradient(lora):
    a, b = lora.adapters["a"], lora.adapters["b"]
    [(_, err)] = run_calls(lora, [Call(b, DATA_B, "cross_entropy", {}, True)])
    want = grads(b)
    overflow = read_data([datum([5, 6, 7], [6, 7, 8], logprobs=[-1.0] * 3, advantages=[3e38] * 3)], 512, ("logprobs", "advantages"))
    (out_a, err_a), (out_b, err_b) = run_calls(lora, [Call(a, overflow, "importance_sampling", {}, True), Call(b, DATA_B, "cross_entropy", {}, True)])
    # the loss is finite (ratios ~ exp(-5)), its gradient is not: the second guard refuses it
    assert out_a is None and isinstance(err_a, NonFiniteStep) and "gradient norm is inf; nothing was applied to adapter a" in str(err_a)
    assert all(p.grad is None for p in a.params.values()) and a.grad_calls == 0
    assert err_b is None and b.grad_calls == 1
    got = grads(b)
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=1e-5, rtol=1e-4)


def test_tenants_take_turns_and_batchable_heads_share_a_forward():
    registry, _ = load_tenants(ServiceSection())
    names = ["t0", "t1", "t2"]
    tenants = [Tenant(name=n, key=f"tml-{n}-0123456789abcdef", max_adapters=1, tokens_per_minute=10**6, queue_depth=99) for n in names]
    sched = Scheduler(registry, run_batch=lambda payloads: [], batch_tokens=100)  # the worker is never started here
    for _ in range(3):
        sched.submit(tenants[0], "forward_backward", None, tokens=10, batch="fb0")
    sched.submit(tenants[1], "optim_step", lambda: None)
    sched.submit(tenants[1], "forward_backward", None, tokens=10, batch="fb1")
    sched.submit(tenants[2], "forward_backward", None, tokens=95, batch="fb2")
    rounds = []
    while items := sched._next():
        rounds.append([(i.tenant.name, i.batch or "alone") for i in items])
    assert rounds == [
        [("t0", "fb0")],  # t1's head runs alone; t2's does not fit beside t0's 10 tokens (95 + 10 > 100)
        [("t1", "alone")],  # passed over, t1 goes first
        [("t2", "fb2")],
        [("t0", "fb0"), ("t1", "fb1")],
        [("t0", "fb0")],
    ]
