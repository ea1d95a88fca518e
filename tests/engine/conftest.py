"""Fixtures of the built-in engine tests: the tiny random Llama (fp32) and its tokenizer, loaded
once per test module from the session's ``tiny_model_dir`` (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from noria.models import load_model, load_tokenizer


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)
