"""OpenMP teams given back (``noria.openmp``): a thread's libgomp workers leave when it gives them back,
and a CPU engine takes the teams of the threads that build it and submit to it. A team is one OS
thread per extra torch thread; its threads take the OS name of the thread that starts them, so each
test names its thread uniquely and counts the threads of that name in ``/proc/self/task`` (threads
of other tests that are still ending do not count)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading

import pytest
import torch

from engine_util import greedy, prompt
from noria import openmp
from noria.config import EngineConfig
from noria.engine import Engine, GenerateRequest

pytestmark = pytest.mark.skipif(not openmp._pause_functions(), reason="torch does not run on libgomp here")


PR_SET_NAME, PR_GET_NAME = 15, 16


@contextlib.contextmanager
def thread_named(name: str):
    """The calling thread under the OS name ``name`` (threads it starts meanwhile inherit it)."""
    libc = ctypes.CDLL(None)
    old = ctypes.create_string_buffer(16)
    libc.prctl(PR_GET_NAME, old, 0, 0, 0)
    libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    try:
        yield name[:15]
    finally:
        libc.prctl(PR_SET_NAME, old, 0, 0, 0)


def named_threads(name: str) -> int:
    count = 0
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            count += open(f"/proc/self/task/{task}/comm").read().strip() == name
    return count


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
        with thread_named(f"omp-{os.getpid() % 100000}") as name:
            parallel_op()
            seen["with team"] = named_threads(name)
            openmp.release_workers()
            seen["after"] = named_threads(name)
            openmp.released(parallel_op)()  # makes the team again, and gives it back
            seen["after released"] = named_threads(name)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == {"with team": 2, "after": 1, "after released": 1}  # the thread itself and its worker


def test_a_cpu_engine_takes_the_submitting_threads_team(tiny_model_dir, two_torch_threads):
    engine = Engine.from_path(tiny_model_dir, EngineConfig(kv_cache_tokens=1024, block_size=4))
    try:
        with thread_named(f"sub-{os.getpid() % 100000}") as name:  # after the build: the engine thread keeps its name
            parallel_op()
            assert named_threads(name) == 2  # this thread and its team's worker
            outs = engine.generate_batch([GenerateRequest(input_ids=prompt(7, s), sampling=greedy(4)) for s in range(3)])
            assert all(len(o.output_ids) == 4 for o in outs)
            assert named_threads(name) == 1  # given back at submit, before the results came
    finally:
        engine.shutdown(drain_timeout_s=1.0)
