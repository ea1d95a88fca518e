"""Weight sync to a real ``noria serve`` subprocess on 127.0.0.1: ipc (the engine's shared staging
area, and the trainer's own /dev/shm segments), gloo broadcast and disk (full, and deltas), with verification; failed
pushes and refused manifests change nothing; KV memory release and resume over HTTP.

CPU only; one server (tiny random Llama, bf16) for the module.
"""

from __future__ import annotations

import asyncio
import os
from multiprocessing import shared_memory

import httpx
import pytest
import torch

from engine_server_util import ServeProcess
from proc_util import beyond_loopback, listening_addresses
from noria.config import SyncConfig
from noria.hardware import auto_dtype
from noria.models import load_model
from noria.sync import WeightSyncError, build_sync, bucketize

CASES = ("ipc", "ipc_segments", "broadcast", "disk", "disk_delta")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = ServeProcess(tiny_model_dir, "--engine.attention", "torch", log_dir=tmp_path_factory.mktemp("logs")).wait_ready()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def trainer(tiny_model_dir) -> dict[str, torch.Tensor]:
    model = load_model(tiny_model_dir, dtype=torch.float32)
    return {n: t.clone() for n, t in model.state_dict().items() if n != "lm_head.weight"}


def state(server) -> tuple[int, dict[str, str]]:
    version = httpx.get(f"{server.url}/get_weight_version", timeout=60).json()["weight_version"]
    return version, httpx.post(f"{server.url}/weights_checksum", json={"algo": "sha256"}, timeout=60).json()["checksums"]


def make_sync(case: str, server, tmp_path):
    transport = {"ipc_segments": "ipc", "disk_delta": "disk"}.get(case, case)
    cfg = SyncConfig(transport=transport, verify=True, bucket_mb=1, delta=case == "disk_delta")
    sync = build_sync(cfg, [server.url], run_dir=tmp_path)
    if case == "ipc_segments":
        sync.transport_impl.use_staging_area = False
    return sync


def sent_for(trainer: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    return {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in trainer.items()}


@pytest.mark.parametrize("case", CASES)
def test_push_to_a_server_and_verify(case, server, trainer, tmp_path):
    version, _ = state(server)
    with make_sync(case, server, tmp_path) as sync:
        for v in (version + 1, version + 2):
            metrics = sync.push(bucketize(sent_for(trainer, v), 30_000), v)  # verify=True: checksums compared
    assert metrics["sync/verify_seconds"] > 0
    if case == "disk_delta":  # the second push: a delta folder through /update_weights_from_disk
        assert metrics["sync/full_snapshots"] == 0 and (tmp_path / "weights" / f"d{version + 2:08d}" / "delta.json").is_file()
    now, sums = state(server)
    assert now == version + 2
    out = httpx.post(f"{server.url}/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}},
                     timeout=60).json()  # 5 s (httpx's default) is short on a loaded machine
    assert out["meta_info"]["weight_version"] == version + 2


@pytest.mark.parametrize("case", CASES)
def test_failed_push_to_a_server_changes_nothing(case, server, trainer, tmp_path):
    before = state(server)
    buckets = list(bucketize(sent_for(trainer, 99), 30_000))

    def dies_midway():
        yield from buckets[:2]
        raise RuntimeError("trainer lost a rank")

    with make_sync(case, server, tmp_path) as sync:
        with pytest.raises(RuntimeError, match="lost a rank"):
            sync.push(dies_midway(), before[0] + 1)
        with pytest.raises(WeightSyncError, match="shape"):
            sync.push(iter([*buckets[:2], [("model.norm.weight", torch.ones(5))]]), before[0] + 1)
    assert state(server) == before


def _segment(tensor: torch.Tensor) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(create=True, size=tensor.numel() * tensor.element_size() + 64)
    view = torch.frombuffer(shm.buf, dtype=torch.uint8)
    view[: tensor.numel() * tensor.element_size()].view(tensor.dtype).copy_(tensor.reshape(-1))
    del view
    return shm


def test_ipc_endpoint_checks_manifests_against_the_segment(server):
    before = state(server)
    norm = torch.full((64,), 0.5, dtype=torch.bfloat16)
    shm = _segment(norm)
    good = {"name": "model.norm.weight", "dtype": "bfloat16", "shape": [64], "offset": 0}
    handle = {"kind": "shm", "name": shm.name, "size": shm.size}
    try:
        refused = [
            ({**handle}, [{**good, "offset": shm.size - 64}], "does not fit"),  # runs past the segment
            ({**handle}, [{**good, "offset": 1}], "aligned"),  # misaligned for bf16
            ({**handle}, [{**good, "shape": [32]}], "shape"),
            ({**handle}, [{**good, "name": "model.nope"}], "unknown tensor"),
            ({**handle, "size": shm.size * 4}, [good], "holds"),  # the segment is smaller than claimed
            ({**handle, "name": "../etc/passwd"}, [good], "bad shared-memory segment name"),
            ({**handle, "name": "noria_sync_gone"}, [good], "not found"),
            ({"kind": "staging"}, [good], "staging"),  # no area was handed out for this update
        ]  # fmt: skip
        for h, tensors, message in refused:
            r = httpx.post(f"{server.url}/update_weights_from_ipc", json={"handle": h, "tensors": tensors, "weight_version": 50})
            assert r.status_code == 400 and message in r.json()["error"]["message"], (message, r.text)
        assert state(server) == before
        r = httpx.post(f"{server.url}/update_weights_from_ipc", json={"handle": handle, "tensors": [good], "weight_version": 50})
        assert r.status_code == 200 and r.json()["weight_version"] == 50
    finally:
        shm.close()
        shm.unlink()
    r = httpx.post(f"{server.url}/commit_weights", json={"update_id": "never-staged", "weight_version": 51})
    assert r.status_code == 400 and "nothing staged" in r.json()["error"]["message"]


def test_staging_area_rejects_writes_at_the_wrong_place(server, trainer):
    area = httpx.post(f"{server.url}/weights_staging_area", json={"update_id": "area-1"}).json()
    assert area["pid"] > 0 and area["size"] > 0 and "model.norm.weight" in area["tensors"]
    before = state(server)
    entry = area["tensors"]["model.norm.weight"]
    wrong = {"name": "model.norm.weight", **entry, "offset": entry["offset"] + 64}
    r = httpx.post(f"{server.url}/update_weights_from_ipc", json={"handle": {"kind": "staging"}, "tensors": [wrong], "update_id": "area-1"})
    assert r.status_code == 400 and "staging buffer is at byte" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/commit_weights", json={"update_id": "area-1", "weight_version": 77})
    assert r.status_code == 400 and "failed earlier" in r.json()["error"]["message"]
    assert state(server) == before


def test_weights_info_and_checksums(server, trainer):
    info = httpx.get(f"{server.url}/weights_info").json()
    assert info["tensors"]["model.norm.weight"] == {"dtype": auto_dtype("cpu"), "shape": [64]}  # the server's dtype: auto
    assert "sha256" in info["checksum_algos"] and info["device"] == "cpu"
    assert set(trainer) < set(info["tensors"])  # the tied lm_head.weight is listed too
    one = httpx.get(f"{server.url}/weights_checksum", params={"names": "model.norm.weight,lm_head.weight"}).json()
    assert set(one["checksums"]) == {"model.norm.weight", "lm_head.weight"} and one["algo"] == "sha256"
    _, sums = state(server)
    assert sums["lm_head.weight"] != sums["model.norm.weight"]
    assert httpx.get(f"{server.url}/weights_checksum", params={"names": "nope"}).status_code == 400


def test_release_and_resume_memory_over_http(server):
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            assert (await client.post("/release_memory_occupation")).status_code == 200
            pending = asyncio.ensure_future(client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}}))
            await asyncio.sleep(0.5)
            assert not pending.done()  # queued while the KV cache is gone
            r = await client.post("/continue_generation")
            assert r.status_code == 400 and "resume_memory_occupation" in r.json()["error"]["message"]
            assert (await client.post("/resume_memory_occupation")).status_code == 200
            out = (await pending).json()
            assert len(out["output_ids"]) == 3

    asyncio.run(scenario())


def test_broadcast_rendezvous_and_group_listen_on_loopback_only(server, trainer, tmp_path):
    """The trainer's rendezvous store and both ranks' gloo sockets stay on 127.0.0.1 (no 0.0.0.0, no ::)."""
    version, _ = state(server)
    with make_sync("broadcast", server, tmp_path) as sync:
        sync.push(bucketize(sent_for(trainer, version + 1), 1 << 20), version + 1)
        assert sync.transport_impl.group is not None  # the group (and its store) is alive now
        mine, theirs = listening_addresses(os.getpid()), listening_addresses(server.process.pid)
        assert mine and theirs
        assert beyond_loopback(mine) == [] and beyond_loopback(theirs) == [], (mine, theirs)


def test_auto_picks_ipc_for_a_noria_engine_on_this_machine_and_broadcast_for_another_server(server):
    import http.server
    import threading

    from noria.sync import HttpEngine, resolve_transport

    assert resolve_transport("auto", [HttpEngine(server.url)]) == "ipc"  # the trainer on the CPU
    assert resolve_transport("auto", [HttpEngine(server.url)], "cpu") == "ipc"

    class NoWeightsInfo(http.server.BaseHTTPRequestHandler):  # a server without /weights_info (SGLang)
        def do_GET(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NoWeightsInfo)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        assert resolve_transport("auto", [HttpEngine(f"http://127.0.0.1:{other.server_port}")]) == "broadcast"
    finally:
        other.shutdown()


PUSH_THEN_WAIT = """
import sys, time, torch
from noria.config import SyncConfig
from noria.models import load_model
from noria.sync import build_sync, bucketize
url, model, version, folder = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
weights = {n: t.clone() for n, t in load_model(model, dtype=torch.float32).state_dict().items() if n != "lm_head.weight"}
sync = build_sync(SyncConfig(transport="ipc", bucket_mb=1), [url], run_dir=folder)
transport, names = sync.transport_impl, []
transport.use_staging_area = False
real_pack = transport._pack
def pack(slot, bucket):  # a spy: the names of the segments the push goes through
    handle, manifest = real_pack(slot, bucket)
    names.append(handle["name"])
    return handle, manifest
transport._pack = pack
sync.push(bucketize(weights, 30_000), version)
print(" ".join(["pushed", *sorted(set(names))]), flush=True)  # one write: PYTHONUNBUFFERED writes each of print's pieces
time.sleep(120)
"""


def test_segments_live_for_one_push(server, tiny_model_dir, tmp_path):
    """A trainer whose whole process group is SIGKILLed between two pushes (a job scheduler's kill:
    the multiprocessing resource tracker, which would unlink what a lone dead trainer left, dies
    too) leaves no /dev/shm segment: they were kept between pushes and stayed there, holding RAM."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from repo_util import ROOT

    version, _ = state(server)
    out = tmp_path / "trainer.out"
    trainer = subprocess.Popen([sys.executable, "-c", PUSH_THEN_WAIT, server.url, str(tiny_model_dir), str(version + 1), str(tmp_path)],
                               stdout=open(out, "wb"), stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)  # noqa: SIM115
    try:
        deadline = time.monotonic() + 120
        while not (text := out.read_text()).startswith("pushed") or not text.endswith("\n"):  # the whole line
            assert trainer.poll() is None and time.monotonic() < deadline, text
            time.sleep(0.1)
        names = text.split()[1:]
        assert names and all(n.startswith(f"noria_sync_{trainer.pid}_") for n in names)  # the push went through segments
        assert state(server)[0] == version + 1
    finally:
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait()
    # the whole group is dead (the resource tracker too): nothing is left to clean up, a leftover stays for good
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"noria_sync_{trainer.pid}_")]
    for name in left:  # removed (the old code's leftovers) so they do not hold this machine's memory
        Path("/dev/shm", name).unlink()
    assert left == []
