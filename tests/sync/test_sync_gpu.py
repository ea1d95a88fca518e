"""Weight sync with CUDA: an in-process engine on the GPU (ipc, disk), a ``noria serve`` on the GPU
fed through a CUDA IPC handle, and an NCCL broadcast to a server on a second GPU. Skipped without
a GPU (the NCCL case without two)."""

from __future__ import annotations

import httpx
import pytest
import torch

from engine_server_util import ServeProcess
from noria.config import EngineConfig, SyncConfig
from noria.engine import Engine
from noria.models import load_model
from noria.sync import HttpEngine, build_sync, bucketize, resolve_transport

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture()
def trainer(tiny_model_dir) -> dict[str, torch.Tensor]:
    model = load_model(tiny_model_dir, dtype=torch.float32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    return {n: t + 0.05 * torch.randn(t.shape, generator=gen, device="cuda") for n, t in model.state_dict().items() if n != "lm_head.weight"}


def _dies_midway(buckets):
    yield from buckets[:2]
    raise RuntimeError("rank lost")


@pytest.mark.parametrize("transport", ["ipc", "disk"])
def test_in_process_cuda_engine(transport, trainer, tiny_model_dir, tmp_path):
    engine = Engine(load_model(tiny_model_dir, dtype=torch.bfloat16, device="cuda"), None, EngineConfig(kv_cache_tokens=256, block_size=4))
    try:
        before = {n: t.clone() for n, t in engine.model.state_dict().items()}
        with build_sync(SyncConfig(transport=transport, verify=True), [engine], run_dir=tmp_path) as sync:
            with pytest.raises(RuntimeError, match="rank lost"):
                sync.push(_dies_midway(list(bucketize(trainer, 30_000))), 1)
            assert engine.weight_version == 0
            assert all(torch.equal(t, before[n]) for n, t in engine.model.state_dict().items())
            sync.push(bucketize(trainer, 30_000), 1)
        state = engine.model.state_dict()
        assert engine.weight_version == 1 and all(torch.equal(state[n], t.to(torch.bfloat16)) for n, t in trainer.items())
    finally:
        engine.shutdown(1)


def test_cuda_ipc_to_a_gpu_server(trainer, tiny_model_dir, tmp_path):
    srv = ServeProcess(tiny_model_dir, "--model.device", "cuda", log_dir=tmp_path).wait_ready(timeout_s=180)
    try:
        with build_sync(SyncConfig(transport="ipc", verify=True, bucket_mb=1), [srv.url]) as sync:
            sent = {n: t.to(torch.bfloat16) for n, t in trainer.items()}
            before = httpx.post(f"{srv.url}/weights_checksum", json={}).json()["checksums"]
            with pytest.raises(RuntimeError, match="rank lost"):
                sync.push(_dies_midway(list(bucketize(sent, 30_000))), 1)
            assert httpx.post(f"{srv.url}/weights_checksum", json={}).json()["checksums"] == before
            sync.push(bucketize(sent, 30_000), 1)  # verified: checksums equal the trainer's
            assert sync.transport_impl._engines_on_cuda()  # went through a CUDA IPC handle, not /dev/shm
        assert httpx.get(f"{srv.url}/get_weight_version").json()["weight_version"] == 1
        # auto: the engine reports the trainer's own GPU (same UUID): CUDA IPC; from the CPU: ipc too
        assert resolve_transport("auto", [HttpEngine(srv.url)], "cuda:0") == "ipc"
        assert resolve_transport("auto", [HttpEngine(srv.url)], "cpu") == "ipc"
    finally:
        assert srv.stop() == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between trainer and engine needs two GPUs")
def test_nccl_broadcast_to_a_server_on_another_gpu(trainer, tiny_model_dir, tmp_path):
    srv = ServeProcess(tiny_model_dir, "--model.device", "cuda:1", log_dir=tmp_path).wait_ready(timeout_s=180)
    try:
        with build_sync(SyncConfig(transport="broadcast", verify=True, bucket_mb=1), [srv.url]) as sync:
            sync.push(bucketize(trainer, 30_000), 1)
            assert sync.transport_impl.backend == "nccl"
        assert resolve_transport("auto", [HttpEngine(srv.url)], "cuda:0") == "broadcast"  # another GPU
    finally:
        assert srv.stop() == 0
