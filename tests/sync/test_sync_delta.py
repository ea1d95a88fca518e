"""Delta weight sync on disk (``sync.transport: disk``, ``sync.delta: true``) to in-process engines.

CPU only; real ``Engine`` objects on the tiny random Llama, real delta and safetensors folders. The
trainer's updates are Adam-sized (every weight moves by about the learning rate), so in bf16 only
some elements change bits, as in RL. The engine dtype is the one ``model.dtype: auto`` resolves to
here (bf16 on an AVX-512-bf16 CPU, fp32 under NORIA_CPU_ISA=avx2) and the other one.
"""

from __future__ import annotations

import http.server
import json
import shutil
import threading

import pytest
import torch

from noria.config import ConfigError, EngineConfig, SyncConfig
from noria.engine import Engine, WeightUpdateError
from noria.hardware import auto_dtype
from noria.models import load_model
from noria.sync import WeightSyncError, build_sync, bucketize

LR = 1e-5
"""Large enough that a few percent of the tiny model's bf16 elements change per step."""
AUTO = getattr(torch, auto_dtype("cpu"))
OTHER = torch.float32 if AUTO == torch.bfloat16 else torch.bfloat16


def make_engine(folder, dtype) -> Engine:
    return Engine(load_model(folder, dtype=dtype), None, EngineConfig(kv_cache_tokens=64, block_size=4, attention="torch"))


@pytest.fixture()
def engines(tiny_model_dir):
    made = []
    yield lambda dtype=AUTO: made.append(make_engine(tiny_model_dir, dtype)) or made[-1]
    for e in made:
        e.shutdown(1)


class Trainer:
    """fp32 master weights taking sign-of-noise steps of size LR (Adam's first steps), the tied head
    left out (as FSDPBackend sends them)."""

    def __init__(self, folder) -> None:
        model = load_model(folder, dtype=torch.float32)
        self.weights = {n: t.clone() for n, t in model.state_dict().items() if n != "lm_head.weight"}
        self.gen = torch.Generator().manual_seed(0)

    def step(self) -> dict[str, torch.Tensor]:
        for t in self.weights.values():
            t += LR * torch.sign(torch.randn(t.shape, generator=self.gen))
        return self.weights


def delta_sync(engines_, tmp_path, verify: bool = True):
    cfg = SyncConfig(transport="disk", delta=True, verify=verify, bucket_mb=1)
    return build_sync(cfg, engines_, run_dir=tmp_path)


@pytest.mark.parametrize("dtype,codec", [(AUTO, "zstd"), (OTHER, "zstd"), (AUTO, "zlib")], ids=str)
def test_engine_after_n_deltas_is_bitwise_the_trainers(dtype, codec, engines, tiny_model_dir, tmp_path, monkeypatch):
    if codec == "zlib":  # as on a machine without the zstandard package
        monkeypatch.setattr("noria.sync.delta.default_codec", lambda: "zlib")
    engine, trainer = engines(dtype), Trainer(tiny_model_dir)
    full_bytes = sum(t.numel() * t.element_size() for t in engine.model.parameters())
    with delta_sync([engine], tmp_path) as sync:  # verify: every tensor's checksum equals the trainer's (cast)
        first = sync.push(bucketize(trainer.step(), 40_000), 1)
        later = [sync.push(bucketize(trainer.step(), 40_000), v) for v in (2, 3, 4)]
        same = sync.push(bucketize(trainer.weights, 40_000), 5)  # nothing changed: only the version moves
    assert same["sync/changed_frac"] == 0 and same["sync/full_snapshots"] == 0 and engine.weight_version == 5
    state = engine.model.state_dict()
    for name, t in trainer.weights.items():
        assert torch.equal(state[name], t.to(dtype)), name
    assert first["sync/full_snapshots"] == 1 and first["sync/changed_frac"] == 1.0
    for m in later:
        assert m["sync/full_snapshots"] == 0 and m["sync/delta_refused"] == 0
        assert 0 < m["sync/changed_frac"] <= 1 and m["sync/bytes_written"] < full_bytes
        if dtype == torch.bfloat16:  # most bf16 elements keep their bits at this step size
            assert m["sync/changed_frac"] < 0.5 and m["sync/bytes_written"] < 0.5 * full_bytes
    folders = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert folders == ["d00000004", "d00000005", "v00000001"]  # only the first push was a full snapshot
    manifest = json.loads((tmp_path / "weights" / "d00000004" / "delta.json").read_text())
    assert manifest["base_version"] == 3 and manifest["version"] == 4 and manifest["codec"] == codec


def test_corrupt_partial_or_foreign_delta_is_refused_and_the_engine_keeps_its_weights(engines, tiny_model_dir, tmp_path):
    leader, follower, trainer = engines(), engines(), Trainer(tiny_model_dir)
    with delta_sync([leader], tmp_path, verify=False) as sync:
        for v in (1, 2, 3):
            sync.push(bucketize(trainer.step(), 40_000), v)
    weights = tmp_path / "weights"
    follower.weights.update_from_disk(weights / "v00000001", 1)
    shutil.copytree(weights / "d00000002", tmp_path / "d2")  # keep an intact copy
    before = {n: t.clone() for n, t in follower.model.state_dict().items()}

    def broken(kind: str):
        folder = tmp_path / kind
        shutil.copytree(tmp_path / "d2", folder)
        data = folder / "delta.bin"
        if kind == "flipped":
            raw = bytearray(data.read_bytes())
            raw[len(raw) // 2] ^= 0x10
            data.write_bytes(bytes(raw))
        elif kind == "truncated":
            data.write_bytes(data.read_bytes()[:-50])
        elif kind == "no_manifest":
            (folder / "delta.json").unlink()
        elif kind == "no_data":
            data.unlink()
        return folder

    cases = [("flipped", "checksum differs"), ("truncated", "truncated or partial"), ("no_manifest", "no delta.json"),
             ("no_data", "no bytes")]  # fmt: skip
    for kind, message in cases:
        with pytest.raises(WeightUpdateError, match=message):
            follower.weights.update_from_disk(broken(kind), 2)
    with pytest.raises(WeightUpdateError, match="applies to version 2, the engine serves 1"):
        follower.weights.update_from_disk(weights / "d00000003", 3)  # it missed version 2
    with pytest.raises(WeightUpdateError, match="makes version 2"):
        follower.weights.update_from_disk(tmp_path / "d2", 5)
    assert follower.weight_version == 1
    for name, t in follower.model.state_dict().items():
        assert torch.equal(t, before[name]), f"{name} changed"
    follower.weights.update_from_disk(tmp_path / "d2", 2)  # the intact delta applies
    follower.weights.update_from_disk(weights / "d00000003", 3)
    leader_state = leader.model.state_dict()
    assert all(torch.equal(t, leader_state[n]) for n, t in follower.model.state_dict().items())


def test_engines_that_missed_versions_or_refuse_a_delta_get_a_full_snapshot(engines, tiny_model_dir, tmp_path):
    a, b, trainer = engines(), engines(), Trainer(tiny_model_dir)
    with delta_sync([a, b], tmp_path) as sync:  # verify on: both end bitwise equal to the trainer
        sync.push(bucketize(trainer.step(), 40_000), 1)
        assert sync.push(bucketize(trainer.step(), 40_000), 2)["sync/full_snapshots"] == 0
        b.weights.update_from_disk(tiny_model_dir, 0)  # b restarted: the original weights, version 0
        m = sync.push(bucketize(trainer.step(), 40_000), 3)
        assert m["sync/full_snapshots"] == 1 and m["sync/delta_refused"] == 0 and b.weight_version == 3
        with torch.no_grad():  # a bit flips in b behind the sync's back: its weights are no longer the base
            b.model.model.layers[0].mlp.up_proj.weight.view(torch.int16)[0, 0] ^= 1
        m = sync.push(bucketize(trainer.step(), 40_000), 4)
        assert m["sync/full_snapshots"] == 1 and m["sync/delta_refused"] == 1
        assert sync.push(bucketize(trainer.step(), 40_000), 5)["sync/full_snapshots"] == 0
    assert a.weight_version == b.weight_version == 5


def test_a_failed_push_leaves_no_base_so_the_next_one_is_full(engines, tiny_model_dir, tmp_path):
    engine, trainer = engines(), Trainer(tiny_model_dir)
    with delta_sync([engine], tmp_path) as sync:
        sync.push(bucketize(trainer.step(), 40_000), 1)
        buckets = list(bucketize(trainer.step(), 40_000))

        def dies_midway():
            yield buckets[0]
            raise RuntimeError("all-gather failed")

        with pytest.raises(RuntimeError, match="all-gather"):
            sync.push(dies_midway(), 2)
        assert engine.weight_version == 1
        assert sync.push(iter(buckets), 2)["sync/full_snapshots"] == 1  # the base was half updated: not trusted
        assert sync.push(bucketize(trainer.step(), 40_000), 3)["sync/full_snapshots"] == 0
    assert not list((tmp_path / "weights").glob(".*partial*"))


def test_delta_is_refused_at_start_for_engines_that_cannot_apply_it(tmp_path):
    with pytest.raises(ConfigError, match="needs sync.transport: disk"):
        SyncConfig(transport="broadcast", delta=True).validate()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)  # not a noria engine
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(WeightSyncError, match=r"cannot apply weight deltas .* set sync.delta false"):
            delta_sync([f"http://127.0.0.1:{server.server_address[1]}"], tmp_path, verify=False)
    finally:
        server.shutdown()
        server.server_close()
