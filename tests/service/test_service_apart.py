"""``noria service`` with its sampling engine in a process of its own (``service.placement:
disaggregated``): a real service and the ``noria serve`` child it starts, on 127.0.0.1.

The samples are checked as the colocated service's are (``check_samples_follow_the_adapter``). Then
the engine is killed: a sample fails naming it while training goes on, and the service stops
without leaving anything running.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from service_util import PROMPT, ServiceProcess, check_samples_follow_the_adapter, target_data, train

from noria.service.client import RequestFailed, ServiceClient

KEYS = {"alice": "tml-alice-0123456789abcdef", "bob": "tml-bob-0123456789abcdef01"}


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


@pytest.fixture(scope="module")
def service(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("service-apart")
    keys = folder / "keys.yaml"
    keys.write_text("tenants:\n" + "".join(f"  {name}: {{key: {key}}}\n" for name, key in KEYS.items()))
    proc = ServiceProcess(tiny_model_dir, keys, folder / "state", folder, "--service.placement", "disaggregated").wait_ready(300)
    yield proc, folder
    proc.stop()


def test_samples_come_from_the_adapters_own_weights_through_the_engine_process(service):
    proc, folder = service
    (engine,) = children(proc.process.pid)
    assert b"noria\x00serve" in Path(f"/proc/{engine}/cmdline").read_bytes()
    check_samples_follow_the_adapter(ServiceClient(proc.url, KEYS["alice"]), ServiceClient(proc.url, KEYS["bob"]))
    assert not list((folder / "state" / ".engine-adapters").iterdir()), "adapter folders are removed once loaded"


def test_a_dead_engine_fails_samples_naming_it_and_training_goes_on_then_nothing_outlives_the_service(service):
    proc, _ = service
    alice = ServiceClient(proc.url, KEYS["alice"])
    trainer = alice.create_lora_training_client(rank=2)
    (engine,) = children(proc.process.pid)
    os.kill(engine, signal.SIGKILL)
    with pytest.raises(RequestFailed, match="engine at http://127.0.0.1:"):
        trainer.sampling_client().sample(PROMPT, 1, {"max_tokens": 3}).result()
    losses = train(trainer, target_data(100), steps=2)
    assert losses[1] < losses[0]
    assert proc.stop() == 0
    deadline = time.monotonic() + 10
    while Path(f"/proc/{engine}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{engine}").exists()


def test_an_engine_url_with_nothing_there_stops_the_start_naming_it(tiny_model_dir, tmp_path):
    from noria.net import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"tenants:\n  alice: {{key: {KEYS['alice']}}}\n")
    proc = ServiceProcess(tiny_model_dir, keys, tmp_path / "state", tmp_path, "--service.placement", "disaggregated", "--service.engine_url", url)
    try:
        assert proc.process.wait(180) != 0
    finally:
        proc.stop()
    assert f"engine at {url} is unreachable" in proc.log_path.read_text(), proc.log_path.read_text()[-2000:]
