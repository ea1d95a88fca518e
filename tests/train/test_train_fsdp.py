"""FSDP2 on two gloo CPU processes against the single-process backend.

Spawns 2 ranks with torch.multiprocessing on a free loopback port; each rank trains the same batch
and rank 0 writes what it saw into a file the test compares with a single-process run (fp32, so
the only difference is reduction order). Also: a NaN loss on ONE rank stops the update on every
rank, a DCP checkpoint written by 2 ranks resumes bit for bit, and LoRA (frozen base weights inside
FSDP units) matches too. About 15 s on 2 cores.
"""

from __future__ import annotations

import os
from noria.net import free_port

import pytest
import torch
import torch.multiprocessing as mp

from noria.train.checkpoint import checkpoint_dir
from noria.train.fsdp import rank_process
from noria.train.packing import pack_samples
from train_util import make_backend, pg_loss, random_samples, weights


LORA = {"enabled": True, "rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "down_proj"]}


def _batch():
    samples = random_samples(7, seed=3)
    return pack_samples(samples, torch.linspace(-1, 1, 7).tolist())


def _nan_on_rank1(x):
    import torch.distributed as dist

    loss, metrics = pg_loss(x)
    return (loss * float("nan") if dist.get_rank() == 1 else loss), metrics


def _worker(rank: int, world: int, port: int, model_dir, out_dir) -> None:
    import torch.distributed as dist

    from noria.train.backend import NonFiniteError
    from noria.train.fsdp import init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    init_distributed("cpu")
    kw = dict(backend="fsdp2", world_size=world, micro_batch_tokens=24, activation_checkpointing=True)
    backend = make_backend(model_dir, **kw)
    batch = _batch()
    logprobs = backend.compute_logprobs(batch).logprobs
    metrics = backend.train_step(batch)
    after = weights(backend)
    ckpt = backend.save(checkpoint_dir(out_dir, 1), extra={"cursor": 3})
    backend.train_step(batch)
    two_steps = weights(backend)
    resumed = make_backend(model_dir, **kw)
    extra = resumed.load(ckpt)
    resumed.train_step(batch)
    resumed_w = weights(resumed)
    sync = [(n, t) for bucket in backend.state_dict_for_sync(1 << 16) for n, t in bucket]
    nan = make_backend(model_dir, loss_fn=_nan_on_rank1, **kw)
    before_nan = weights(nan)
    try:
        nan.train_step(batch)
        raised = ""
    except NonFiniteError as e:
        raised = str(e)
    nan_unchanged = all(torch.equal(t, before_nan[k]) for k, t in weights(nan).items())
    lora = make_backend(model_dir, lora=LORA, **kw)
    lora.train_step(batch)
    lora_w = weights(lora)
    if rank == 0:
        torch.save(
            dict(logprobs=logprobs, metrics=metrics, after=after, two_steps=two_steps, resumed=resumed_w,
                 extra=extra, sync=sync, raised=raised, nan_unchanged=nan_unchanged, lora=lora_w),
            out_dir / "rank0.pt",
        )
    else:
        assert sync == [] and raised and nan_unchanged


def test_fsdp2_two_gloo_ranks_match_single_process(tiny_model_dir, tmp_path):
    mp.spawn(rank_process, args=(_worker, 2, free_port(), tiny_model_dir, tmp_path), nprocs=2, join=True)
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)

    torch.set_num_threads(1)
    single = make_backend(tiny_model_dir, micro_batch_tokens=24)
    batch = _batch()
    torch.testing.assert_close(got["logprobs"], single.compute_logprobs(batch).logprobs, atol=1e-5, rtol=1e-5)
    metrics = single.train_step(batch)
    assert got["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-5)
    assert got["metrics"]["pg"] == pytest.approx(metrics["pg"], rel=1e-5)
    assert got["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
    for name, t in weights(single).items():
        torch.testing.assert_close(got["after"][name], t, atol=1e-4, rtol=0)  # see the split test

    for name, t in got["two_steps"].items():
        assert torch.equal(got["resumed"][name], t), name
    assert got["extra"] == {"cursor": 3}
    assert [n for n, _ in got["sync"]] == [n for bucket in single.state_dict_for_sync(1 << 16) for n, _ in bucket]
    assert "step 1" in got["raised"] and got["nan_unchanged"]

    single_lora = make_backend(tiny_model_dir, micro_batch_tokens=24, lora=LORA)
    single_lora.train_step(batch)
    for name, t in weights(single_lora).items():
        torch.testing.assert_close(got["lora"][name], t, atol=1e-4, rtol=0)
