"""Trainer backend on CUDA: single process (bf16 autocast, reference visiting the GPU) and FSDP2
over NCCL on every visible GPU, compared against each other. Skipped without a GPU."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from noria.train.packing import pack_samples
from train_util import critic_config, grouped_samples, make_backend, random_samples, samples_with_rewards, weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _batch():
    return pack_samples(random_samples(9, seed=5), torch.linspace(-1, 1, 9).tolist())


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, model_dir, out_dir):
    import torch.distributed as dist

    from noria.train.fsdp import init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    init_distributed("cuda")
    try:
        kw = dict(backend="fsdp2", world_size=world, device="cuda", micro_batch_tokens=24, activation_checkpointing=True)
        backend = make_backend(model_dir, param_dtype="float32", loss={"kl_coef": 0.1}, loss_fn=None, **kw)
        batch = _batch()
        lp = backend.compute_logprobs(batch).logprobs
        metrics = backend.train_step(batch)
        w = weights(backend)
        ref_device = next(backend.frozen["reference"].parameters()).device.type
        sync = [(n, t.device.type, t.dtype) for b in backend.state_dict_for_sync(1 << 16) for n, t in b]
        backend.save(out_dir / "ckpt", extra={"k": 1})
        bf16 = make_backend(model_dir, **kw)
        m16 = bf16.train_step(batch)
        if rank == 0:
            torch.save(dict(lp=lp, metrics=metrics, w={k: v.cpu() for k, v in w.items()}, ref_device=ref_device, sync=sync, m16=m16), out_dir / "gpu.pt")
    finally:
        dist.destroy_process_group()


def test_fsdp2_nccl_matches_single_cuda(tiny_model_dir, tmp_path):
    world = torch.cuda.device_count()
    mp.spawn(_worker, args=(world, _port(), tiny_model_dir, tmp_path), nprocs=world, join=True)
    got = torch.load(tmp_path / "gpu.pt", weights_only=False)
    single = make_backend(tiny_model_dir, device="cuda", param_dtype="float32", micro_batch_tokens=24, loss={"kl_coef": 0.1}, loss_fn=None)
    assert next(single.frozen["reference"].parameters()).device.type == "cpu"  # off the GPU when idle
    assert got["ref_device"] == "cpu"
    batch = _batch()
    torch.testing.assert_close(got["lp"], single.compute_logprobs(batch).logprobs, atol=1e-4, rtol=1e-4)
    m = single.train_step(batch)
    assert got["metrics"]["grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-3)
    for name, t in weights(single).items():
        torch.testing.assert_close(got["w"][name], t.cpu(), atol=2e-4, rtol=0)
    assert {(d, dt) for _, d, dt in got["sync"]} == {("cuda", torch.float32)}
    # bf16: FSDP2's cast parameters vs the single path's autocast: close, not equal (module docstring).
    bf16 = make_backend(tiny_model_dir, device="cuda", micro_batch_tokens=24)
    m16 = bf16.train_step(batch)
    assert got["m16"]["skipped"] == 0.0 and got["m16"]["grad_norm"] == pytest.approx(m16["grad_norm"], rel=0.05)


def test_shared_prefix_and_critic_on_cuda(tiny_model_dir):
    """Shared-prefix packing on the GPU gives the plain packing's logprobs and step; the PPO critic
    trains there too."""
    from noria.train.critic import CriticBackend, ppo_train

    samples = grouped_samples(groups=((12, 4), (9, 3), (5, 1)), vocab=200)
    batch = pack_samples(samples, torch.linspace(-1, 1, len(samples)).tolist())
    plain = make_backend(tiny_model_dir, loss_fn=None, device="cuda", share_prefix=False, micro_batch_tokens=40)
    shared = make_backend(tiny_model_dir, loss_fn=None, device="cuda", share_prefix=True, micro_batch_tokens=40)
    torch.testing.assert_close(shared.compute_logprobs(batch).logprobs, plain.compute_logprobs(batch).logprobs, atol=1e-4, rtol=1e-4)
    m_plain, m_shared = plain.train_step(batch), shared.train_step(batch)
    assert abs(m_plain["loss"] - m_shared["loss"]) < 1e-4 and abs(m_plain["grad_norm"] - m_shared["grad_norm"]) < 1e-3
    cfg = critic_config()
    cfg.device = "cuda"
    cfg.loss.advantage = "gae"
    critic = CriticBackend(cfg)
    critic.init(tiny_model_dir)
    parts = ppo_train(shared, critic, samples_with_rewards(), cfg, steps=1)
    assert parts[0]["critic/skipped"] == 0.0 and parts[0]["critic/value_loss"] > 0


def test_compiled_layers_train_like_eager(tiny_model_dir):
    """train.compile: the same logprobs and step as the eager layers (fp32: inductor's fused
    elementwise kernels reorder only rounding), with checkpointing, over packings of new lengths
    (attention is not traced, so a new packing must not break or change anything)."""
    import torch._dynamo

    torch._dynamo.reset()
    kw = dict(loss_fn=None, device="cuda", micro_batch_tokens=40, activation_checkpointing=True)
    eager = make_backend(tiny_model_dir, **kw)
    compiled = make_backend(tiny_model_dir, compile=True, **kw)
    for seed, n in ((5, 9), (6, 7), (7, 11)):
        batch = pack_samples(random_samples(n, seed=seed), torch.linspace(-1, 1, n).tolist())
        torch.testing.assert_close(compiled.compute_logprobs(batch).logprobs, eager.compute_logprobs(batch).logprobs,
                                   atol=1e-4, rtol=1e-4)
        m_e, m_c = eager.train_step(batch), compiled.train_step(batch)
        assert m_c["skipped"] == 0.0 and m_c["loss"] == pytest.approx(m_e["loss"], abs=1e-4)
        assert m_c["grad_norm"] == pytest.approx(m_e["grad_norm"], rel=1e-3)
    got = weights(compiled)
    for name, t in weights(eager).items():
        torch.testing.assert_close(got[name], t, atol=1e-4, rtol=0)
