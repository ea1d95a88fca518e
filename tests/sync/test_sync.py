"""Weight sync to in-process engines: every transport, failure semantics, verification, memory release.

CPU only; real ``Engine`` objects on the tiny random Llama (tied embeddings), real gloo groups, real
safetensors folders. A failed update must leave the engine's weights bit for bit and its version.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading

import pytest
import torch

from noria.config import EngineConfig, SyncConfig
from noria.engine import Engine, GenerateRequest, RequestError, SamplingParams, WeightUpdateError
from noria.engine.weight_sources import create_update_group, flat_offsets, send_broadcast
from noria.models import load_model
from noria.net import free_port
from noria.sync import WeightSyncError, build_sync, bucketize, resolve_transport
from noria.sync.disk import write_safetensors
from noria.sync.targets import HttpEngine, LocalTarget

TRANSPORTS = ("ipc", "broadcast", "disk")
REQ = GenerateRequest(input_ids=[5, 9, 17, 33], sampling=SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))


@pytest.fixture()
def engine(tiny_model_dir):
    e = Engine(load_model(tiny_model_dir, dtype=torch.bfloat16), None, EngineConfig(kv_cache_tokens=256, block_size=4, attention="torch"))
    yield e
    e.shutdown(1)


@pytest.fixture()
def trainer(tiny_model_dir) -> dict[str, torch.Tensor]:
    """The trainer's new weights: fp32, perturbed, the tied head left out (as FSDPBackend sends them)."""
    model = load_model(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    return {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in model.state_dict().items() if n != "lm_head.weight"}


def snapshot(engine: Engine) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in engine.model.state_dict().items()}


def assert_unchanged(engine: Engine, before: dict[str, torch.Tensor], version: int = 0) -> None:
    assert engine.weight_version == version
    for name, t in engine.model.state_dict().items():
        assert torch.equal(t, before[name]), f"{name} changed"


def sync_for(transport: str, engine: Engine, tmp_path, verify: bool = True, **kw):
    return build_sync(SyncConfig(transport=transport, verify=verify, bucket_mb=1), [engine], run_dir=tmp_path, **kw)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_push_updates_every_tensor_and_the_version(transport, engine, trainer, tmp_path):
    with sync_for(transport, engine, tmp_path) as sync:
        assert sync.transport == transport
        for version in (1, 2):  # the second push reuses groups, buffers and staging memory
            sent = {n: t + version for n, t in trainer.items()}
            metrics = sync.push(bucketize(sent, 40_000), version)
            assert engine.weight_version == version
            state = engine.model.state_dict()
            for name, t in sent.items():
                assert torch.equal(state[name], t.to(torch.bfloat16)), name
            assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])  # still tied
    nbytes = sum(t.numel() * 2 for t in trainer.values())  # fp32 given, bf16 on the engine: what crosses
    assert metrics["sync/bytes"] == nbytes and metrics["sync/tensors"] == len(trainer)
    assert metrics["sync/seconds"] > 0 and metrics["sync/gb_per_s"] > 0 and metrics["sync/verify_seconds"] > 0
    out = engine.generate_batch([REQ])[0]
    assert out.weight_versions == [2] * 4


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_failed_push_changes_nothing(transport, engine, trainer, tmp_path):
    before = snapshot(engine)
    buckets = list(bucketize(trainer, 40_000))
    assert len(buckets) > 2

    def trainer_dies_midway():
        yield buckets[0]
        yield buckets[1]
        raise RuntimeError("all-gather failed")

    with sync_for(transport, engine, tmp_path) as sync:
        with pytest.raises(RuntimeError, match="all-gather"):
            sync.push(trainer_dies_midway(), 1)
        assert_unchanged(engine, before)
        wrong_shape = [*buckets[:2], [("model.norm.weight", torch.ones(3))]]
        with pytest.raises(WeightSyncError, match=r"model\.norm\.weight.*shape"):
            sync.push(iter(wrong_shape), 1)
        with pytest.raises(WeightSyncError, match="unknown tensor 'model.layers.7.mlp.up_proj.weight'"):
            sync.push(iter([*buckets[:1], [("model.layers.7.mlp.up_proj.weight", torch.ones(2))]]), 1)
        with pytest.raises(WeightSyncError, match="appears twice"):
            sync.push(iter([buckets[0], buckets[0]]), 1)
        assert_unchanged(engine, before)
        sync.push(iter(buckets), 1)  # the sync still works afterwards
    assert engine.weight_version == 1
    if transport == "disk":
        assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v00000001"]  # failed pushes left nothing


def test_verify_names_the_tensor_and_engine(engine, trainer, tmp_path):
    with sync_for("ipc", engine, tmp_path) as sync:
        sync.push(bucketize(trainer, 1 << 20), 3)
        assert sync.verify_tensors(trainer.items(), 3) > 0
        with torch.no_grad():  # a bit flips in the engine behind the sync's back
            engine.model.model.layers[1].mlp.down_proj.weight.view(torch.int16)[0, 0] ^= 1
        with pytest.raises(WeightSyncError, match=r"tensor 'model\.layers\.1\.mlp\.down_proj\.weight' on engine local\[0\] differs"):
            sync.verify_tensors(trainer.items(), 3)
        with pytest.raises(WeightSyncError, match="serves weight version 3, not 4"):
            sync.verify_tensors(trainer.items(), 4)


def test_tied_head_follows_the_embedding_and_refuses_disagreement(engine, trainer, tmp_path):
    with sync_for("ipc", engine, tmp_path) as sync:
        embed = trainer["model.embed_tokens.weight"]
        sync.push(iter([[("lm_head.weight", embed + 1)]]), 1)  # either name of a tied pair stages both
        assert torch.equal(engine.model.model.embed_tokens.weight, (embed + 1).to(torch.bfloat16))
        sync.push(iter([[("model.embed_tokens.weight", embed), ("lm_head.weight", embed.clone())]]), 2)  # same values: fine
        before = snapshot(engine)
        with pytest.raises(WeightSyncError, match="tied parameter"):
            sync.push(iter([[("model.embed_tokens.weight", embed), ("lm_head.weight", embed * 2)]]), 3)
        assert_unchanged(engine, before, version=2)


def test_engine_stages_parts_atomically(engine, trainer):
    before = snapshot(engine)
    buckets = list(bucketize(trainer, 40_000))
    engine.weights.stage(buckets[0], "u1")
    with pytest.raises(WeightUpdateError, match="shape"):
        engine.weights.stage([("model.norm.weight", torch.ones(3))], "u1")
    with pytest.raises(WeightUpdateError, match="failed earlier"):  # half an update can never be committed
        engine.weights.commit("u1", 1)
    with pytest.raises(WeightUpdateError, match="failed earlier"):
        engine.weights.stage(buckets[1], "u1")
    engine.weights.stage(buckets[0], "u2")
    engine.weights.stage(buckets[1], "u3")  # a new update drops the parts of an older, uncommitted one
    with pytest.raises(WeightUpdateError, match="nothing staged"):
        engine.weights.commit("u2", 1)
    with pytest.raises(WeightUpdateError, match="dtype int64"):
        engine.weights.stage([("model.norm.weight", torch.ones(64, dtype=torch.long))], "u4")
    assert_unchanged(engine, before)
    engine.weights.stage(buckets[0], "u5")
    engine.weights.stage(buckets[1], "u5")
    assert sorted(engine.weights.commit("u5", 7)) == sorted(n for b in buckets[:2] for n, _ in b)
    assert engine.weight_version == 7


def _folder(path, tensors: dict[str, torch.Tensor], shards: int = 2):
    path.mkdir()
    items = list(tensors.items())
    per = -(-len(items) // shards)
    weight_map = {}
    for k in range(shards):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(path / name, items[k * per : (k + 1) * per])
        weight_map.update({n: name for n, _ in items[k * per : (k + 1) * per]})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path, [path / f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]


def test_disk_update_reads_everything_before_it_changes_anything(engine, trainer, tmp_path):
    before = snapshot(engine)
    truncated, files = _folder(tmp_path / "truncated", trainer)
    data = files[1].read_bytes()
    files[1].write_bytes(data[: len(data) - 100])  # the second shard lost its tail: the first shard is fine
    missing, files = _folder(tmp_path / "missing", trainer)
    files[1].unlink()
    bad_shape, _ = _folder(tmp_path / "bad_shape", {**trainer, "model.norm.weight": torch.ones(3)})
    garbage, files = _folder(tmp_path / "garbage", trainer)
    files[1].write_bytes(b"\xff" * 64)
    cases = [(truncated, "truncated or corrupt"), (missing, "does not exist"), (bad_shape, "shape"),
             (garbage, "header length"), (tmp_path / "nowhere", "nowhere")]  # fmt: skip
    for folder, message in cases:
        with pytest.raises(WeightUpdateError, match=message):
            engine.weights.update_from_disk(folder, 5)
        assert_unchanged(engine, before)
    good, _ = _folder(tmp_path / "good", trainer)
    engine.weights.update_from_disk(good, 5)
    assert engine.weight_version == 5
    assert torch.equal(engine.model.model.norm.weight, trainer["model.norm.weight"].to(torch.bfloat16))


def test_disk_folder_is_a_complete_versioned_hf_checkpoint(engine, trainer, tiny_model_dir, tmp_path):
    with sync_for("disk", engine, tmp_path, source=tiny_model_dir) as sync:
        for version in (1, 2, 3):
            sync.push(bucketize(trainer, 40_000), version)
    folders = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert folders == ["v00000002", "v00000003"]  # published by rename; older ones pruned
    latest = tmp_path / "weights" / "v00000003"
    assert (latest / "config.json").is_file() and (latest / "tokenizer.json").is_file()
    index = json.loads((latest / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(trainer)
    loaded = load_model(latest, dtype=torch.float32)  # what an external server would load
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in trainer.items())
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(latest)
    assert torch.equal(hf.state_dict()["model.norm.weight"], trainer["model.norm.weight"])


def test_broadcast_refusal_still_receives_so_the_trainer_never_blocks(engine, trainer):
    port = free_port()
    group = {}
    host = threading.Thread(target=lambda: group.update(g=create_update_group("127.0.0.1", port, 0, 2, "t", "gloo", timeout_s=60)))
    host.start()
    engine.weights.join_group("127.0.0.1", port, 1, 2, "t", "gloo")
    host.join()
    before = snapshot(engine)
    sent = {"model.norm.weight": trainer["model.norm.weight"], "model.layers.0.mlp.up_proj.weight": torch.ones(3, 3)}
    sender = threading.Thread(target=send_broadcast, args=(group["g"], sent))
    sender.start()
    with pytest.raises(WeightUpdateError, match="up_proj.weight' has shape"):
        engine.weights.update_from_distributed(list(sent), ["float32"] * 2, [list(t.shape) for t in sent.values()], 1, "t")
    sender.join(timeout=30)
    assert not sender.is_alive()  # every tensor was received
    assert_unchanged(engine, before)


def test_broadcast_refusal_of_a_flat_chunk_is_drained_too(engine, trainer):
    port = free_port()
    group = {}
    host = threading.Thread(target=lambda: group.update(g=create_update_group("127.0.0.1", port, 0, 2, "c", "gloo", timeout_s=60)))
    host.start()
    engine.weights.join_group("127.0.0.1", port, 1, 2, "c", "gloo")
    host.join()
    before = snapshot(engine)
    dtypes, shapes = [torch.float32, torch.float32], [(64,), (3, 3)]
    _, size = flat_offsets(dtypes, shapes)
    sender = threading.Thread(target=lambda: group["g"].broadcast(torch.zeros(size, dtype=torch.uint8), 0).wait())
    sender.start()
    with pytest.raises(WeightUpdateError, match="up_proj.weight' has shape"):
        engine.weights.stage_from_distributed(["model.norm.weight", "model.layers.0.mlp.up_proj.weight"], ["float32"] * 2,
                                              [list(s) for s in shapes], "c", "u-flat", chunks=[2])  # fmt: skip
    sender.join(timeout=30)
    assert not sender.is_alive()
    assert_unchanged(engine, before)


def test_broadcast_lands_chunks_whatever_the_order(engine, trainer, tmp_path):
    backwards = list(reversed(trainer.items()))  # not the engine's layout: received, then copied out
    with sync_for("broadcast", engine, tmp_path) as sync:
        sync.push(iter([backwards[:7], backwards[7:]]), 1)  # verified
        sync.push(bucketize(trainer, 1 << 20), 2)  # the engine's own order: received in place


def test_release_and_resume_memory_occupation(engine):
    expected = engine.generate_batch([REQ])[0].output_ids
    engine.flush_cache()
    capacity = engine.kv.k_pools[0].shape
    engine.release_memory_occupation()
    assert engine.memory_released and all(p.numel() == 0 for p in engine.kv.k_pools + engine.kv.v_pools)
    waiting = [engine.submit(REQ, lambda out: None)]  # accepted, queued until the memory is back
    with pytest.raises(RequestError, match="resume_memory_occupation"):
        asyncio.run(engine.resume())
    assert engine.get_load()["num_waiting_reqs"] == len(waiting)
    engine.resume_memory_occupation()
    assert not engine.memory_released and engine.kv.k_pools[0].shape == capacity
    assert engine.generate_batch([REQ])[0].output_ids == expected


def test_release_retracts_running_requests_which_finish_after_resume(engine):
    long = GenerateRequest(input_ids=[5, 9, 17, 33], sampling=SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True))
    started, done = threading.Event(), concurrent.futures.Future()
    engine.submit(long, lambda out: done.set_result(out) if out.finished else started.set(), stream=True)
    assert started.wait(30)
    asyncio.run(engine.pause("in_place"))  # paused by the caller before the release: stays paused after
    engine.release_memory_occupation()
    assert engine.scheduler.retractions == 1 and not done.done()
    engine.resume_memory_occupation()
    assert engine.get_load()["num_waiting_reqs"] == 1 and not done.done()
    asyncio.run(engine.resume())
    out = done.result(timeout=60)
    assert len(out.output_ids) == 64 and out.finish_reason["type"] == "length"


def test_transport_resolution():
    # Engines on this machine are resolved by asking them (tests/sync/test_sync_http.py); an engine on
    # another machine gets disk without being asked (192.0.2.1: TEST-NET, never this machine).
    local, http, remote = LocalTarget(object(), "local[0]"), HttpEngine("http://127.0.0.1:9"), HttpEngine("http://192.0.2.1:9")
    assert resolve_transport("auto", [local]) == "ipc"
    assert resolve_transport("auto", [remote]) == "disk"
    assert resolve_transport("broadcast", [http]) == "broadcast"
    assert resolve_transport("disk", [local, http]) == "disk"
    with pytest.raises(WeightSyncError, match="choose"):
        resolve_transport("auto", [local, http])
    with pytest.raises(WeightSyncError, match="disk_dir"):
        build_sync(SyncConfig(transport="disk"), [http])
    with pytest.raises(WeightSyncError, match="expected an Engine"):
        build_sync(SyncConfig(), [42])
    http.close()
