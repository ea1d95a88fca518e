"""OpenMP teams given back (``noria.openmp``): a thread's libgomp workers leave when it gives them back,
and a CPU engine takes the teams of the threads that build it and submit to it (each team is one OS
thread per extra torch thread, counted in ``/proc/self/task``)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from engine_util import greedy, prompt, wait_until
from noria import openmp
from noria.config import EngineConfig
from noria.engine import Engine, GenerateRequest

pytestmark = pytest.mark.skipif(not openmp._pause_functions(), reason="torch does not run on libgomp here")


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def parallel_op() -> None:
    """A torch op large enough to run on every torch thread (its first one makes the thread's team)."""
    torch.ones(1 << 22).sum()


@pytest.fixture()
def two_torch_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


def test_release_workers_ends_the_calling_threads_team(two_torch_threads):
    seen = {}

    def work():
        before = os_threads()
        parallel_op()
        seen["with team"] = os_threads() - before
        openmp.release_workers()
        seen["after"] = os_threads() - before
        openmp.released(parallel_op)()  # makes the team again, and gives it back
        seen["after released"] = os_threads() - before

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == {"with team": 1, "after": 0, "after released": 0}


def test_a_cpu_engine_takes_the_submitting_threads_team(tiny_model_dir, two_torch_threads):
    engine = Engine.from_path(tiny_model_dir, EngineConfig(kv_cache_tokens=1024, block_size=4))
    try:
        base = os_threads()  # the building thread's team is gone; the engine thread has run nothing yet
        parallel_op()
        assert os_threads() == base + 1  # this thread's team
        outs = engine.generate_batch([GenerateRequest(input_ids=prompt(7, s), sampling=greedy(4)) for s in range(3)])
        assert all(len(o.output_ids) == 4 for o in outs)
        wait_until(lambda: os_threads() == base, timeout=10.0)  # ours given back at submit; the engine's when idle
    finally:
        engine.shutdown(drain_timeout_s=1.0)
