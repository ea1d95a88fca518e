"""LoRA through peft: only adapters train, merged sync equals the adapted model, adapter sync.

CPU, tiny random Llama; needs peft (the ``cpu`` extra). About two seconds.
"""

from __future__ import annotations

import pytest
import torch

from noria.train.packing import pack_samples
from train_util import make_backend, random_samples

pytest.importorskip("peft")

LORA = {"enabled": True, "rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _with_lora(model_dir, sync="merged", **kw):
    return make_backend(model_dir, lora={**LORA, "sync": sync}, **kw)


def _batch():
    return pack_samples(random_samples(5, seed=4), [1.0, -1.0, 0.5, -0.5, 2.0])


def test_only_adapters_train_and_merged_weights_reproduce_the_model(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    backend = _with_lora(tiny_model_dir)
    trainable = {n for n, p in backend.lm.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert sum(len(g["params"]) for g in backend.optimizer.param_groups) == len(trainable)
    base_before = {n: p.clone() for n, p in backend.lm.named_parameters() if not p.requires_grad}
    backend.train_step(_batch())
    backend.train_step(_batch())
    for n, p in backend.lm.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base_before[n]), n

    merged = dict(kv for bucket in backend.state_dict_for_sync(1 << 20) for kv in bucket)
    hf_names = set(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()) - {"lm_head.weight"}
    assert set(merged) == hf_names
    out = backend.export_hf(tmp_path / "merged", dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, backend.lm(ids), atol=1e-5, rtol=1e-5)


def test_adapter_sync_yields_peft_names(tiny_model_dir):
    backend = _with_lora(tiny_model_dir, sync="adapter", param_dtype="bfloat16")
    tensors = dict(kv for bucket in backend.state_dict_for_sync(1 << 20) for kv in bucket)
    assert len(tensors) == 2 * 3 * 2  # A and B, 3 targets, 2 layers
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (64, 4)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


def test_the_export_writes_the_adapter_alone_and_a_run_can_start_from_it(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    backend = _with_lora(tiny_model_dir)
    backend.train_step(_batch())
    out = backend.export_hf(tmp_path / "final", dtype=torch.float32)
    adapter = out / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    # peft itself loads the adapter onto the base model: the same function as the merged export
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapter).eval()
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, merged(ids).logits, atol=1e-5, rtol=1e-5)

    # train.lora.adapter_path: a new run starts from those adapters
    again = make_backend(tiny_model_dir, lora={**LORA, "adapter_path": str(adapter)})
    before = {n: p for n, p in backend.lm.named_parameters() if ".lora_" in n}
    after = {n: p for n, p in again.lm.named_parameters() if ".lora_" in n}
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    with pytest.raises(ValueError, match="the adapter has .*'r': 4.*train.lora asks for .*'r': 8"):
        make_backend(tiny_model_dir, lora={**LORA, "rank": 8, "adapter_path": str(adapter)})
