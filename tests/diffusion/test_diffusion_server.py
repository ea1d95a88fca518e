"""``noria serve`` of a DiT folder: a real server process on loopback gives the same images as the
in-process engine, takes weight pushes over broadcast and disk (checksums verified), refuses bad
requests naming the field, and stops cleanly."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from diffusion_util import diffusion_config, train_config, write_dit
from engine_server_util import ServeProcess
from noria.config import EngineConfig, SyncConfig


@pytest.fixture(scope="module")
def dit(tmp_path_factory):
    return write_dit(tmp_path_factory.mktemp("dit") / "model")


@pytest.fixture(scope="module")
def server(dit, tmp_path_factory):
    proc = ServeProcess(dit, "--engine.deterministic", "true", "--dtype", "float32", log_dir=tmp_path_factory.mktemp("logs"))
    try:
        yield proc.wait_ready()
    finally:
        assert proc.stop() == 0, proc.read_log()


def test_http_images_equal_in_process_images(dit, server):
    from noria.diffusion.engine import DiffusionEngine
    from noria.diffusion.protocol import ImageRequest
    from noria.diffusion.server import DiffusionHttpClient

    reqs = [ImageRequest(label=c, seed=40 + c, steps=5) for c in range(4)]
    client = DiffusionHttpClient(server.url)

    async def over_http():
        try:
            return await asyncio.gather(*(client.generate(r) for r in reqs))
        finally:
            await client.aclose()

    remote = asyncio.run(over_http())
    engine = DiffusionEngine.from_path(dit, EngineConfig(deterministic=True), dtype="float32")
    local = engine.generate_batch(reqs)
    engine.shutdown()
    for r, l in zip(remote, local):
        assert torch.equal(r.latents, l.latents) and r.logprobs == l.logprobs and r.weight_versions == [0] * 5


@pytest.mark.parametrize("transport", ["broadcast", "disk"])
def test_weight_push_to_the_server(dit, server, transport, tmp_path):
    from noria.diffusion.trainer import DiffusionTrainer
    from noria.sync import HttpEngine, build_sync

    trainer = DiffusionTrainer(train_config(param_dtype="float32"), diffusion_config())
    trainer.init(dit)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.mul_(1.01)
    version = httpx.get(f"{server.url}/get_weight_version").json()["weight_version"] + 1
    sync = build_sync(SyncConfig(transport=transport, verify=True), [HttpEngine(server.url)], run_dir=tmp_path, source=dit)
    try:
        sync.push(trainer.state_dict_for_sync(1 << 20), version=version)  # verify: every checksum equal
    finally:
        sync.close()
    assert httpx.get(f"{server.url}/get_weight_version").json()["weight_version"] == version


def test_bad_image_requests_answer_400_naming_the_field(server):
    r = httpx.post(f"{server.url}/generate_image", json={"label": 1, "seed": 2, "steps": -1})
    assert r.status_code == 400 and "steps" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/generate_image", json={"label": 99, "seed": 2})
    assert r.status_code == 400 and "label" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/generate_image", json={"label": 1})
    assert r.status_code == 400 and "seed" in r.json()["error"]["message"]
    assert httpx.post(f"{server.url}/generate", json={"input_ids": [1]}).status_code == 404
