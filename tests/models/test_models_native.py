"""Native decoder vs transformers, attention contexts, and HF checkpoint round trips (CPU, fp32).

Each family is a random tiny model built from transformers' own config class and saved with
``save_pretrained``; weights are re-drawn larger than HF's init (std 0.02 would make every logit
near zero and hide errors), with random biases and norm scales.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from noria.models import (
    CausalContext,
    CheckpointMismatch,
    DecoderLM,
    ModelArgs,
    PackedContext,
    PaddedContext,
    load_model,
    load_tokenizer,
    save_model,
)
from noria.models.decoder import rope_inv_freq

TOL = 1e-4
VOCAB = 96
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _hf_config(family: str, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family in ("llama", "llama3-rope", "llama-linear-rope", "llama-bias"):
        extra = {
            "llama3-rope": {"rope_parameters": dict(LLAMA3_ROPE)},
            "llama-linear-rope": {
                "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
            },
            "llama-bias": {"attention_bias": True, "mlp_bias": True},
        }.get(family, {})
        return LlamaConfig(**{**base, **extra, **overrides})
    if family == "qwen2":
        return Qwen2Config(**{**base, "tie_word_embeddings": True, **overrides})
    if family == "qwen3":
        # head_dim 32 != hidden / heads = 16: the explicit value must win.
        return Qwen3Config(**{**base, "head_dim": 32, **overrides})
    raise ValueError(family)


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * noise)
        elif p.dim() == 1:
            p.copy_(0.1 * noise)
        else:
            p.copy_(noise / p.shape[-1] ** 0.5)


def _tiny_hf(family: str, folder, **overrides):
    """Save a random tiny HF model of ``family`` to ``folder``; return the HF model (eval, fp32)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config(family, **overrides))
    _randomize(model)
    model.save_pretrained(folder)
    return model.eval()


def _ids(batch: int, seq_len: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


FAMILIES = ["llama", "llama-bias", "llama3-rope", "llama-linear-rope", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = _tiny_hf(request.param, folder)
    return request.param, folder, hf, load_model(folder)


@torch.no_grad()
def test_logits_match_transformers(family_pair):
    family, _, hf, native = family_pair
    assert isinstance(native, DecoderLM)
    ids = _ids(3, 24)
    logits = native(ids)
    assert logits.std() > 0.5  # weights large enough that a wrong op would show
    diff = (logits - hf(ids).logits).abs().max().item()
    print(f"\n[max-abs-diff] {family}: {diff:.3e}")
    assert diff <= TOL


@torch.no_grad()
def test_hidden_states_and_head_give_logits(family_pair):
    _, _, _, native = family_pair
    ids = _ids(2, 10)
    hidden = native.hidden_states(ids)
    assert hidden.shape == (2, 10, native.args.hidden_size)
    assert torch.equal(native.lm_head(hidden), native(ids))


@torch.no_grad()
def test_padded_context_equals_unpadded_rows(family_pair):
    _, _, _, native = family_pair
    lens, seq_len = [7, 3, 12], 12
    rows = [_ids(1, n, seed=10 + i)[0] for i, n in enumerate(lens)]
    ids = torch.zeros(len(lens), seq_len, dtype=torch.long)
    mask = torch.zeros(len(lens), seq_len, dtype=torch.long)
    for i, row in enumerate(rows):  # left padding, as for generation
        ids[i, seq_len - len(row) :] = row
        mask[i, seq_len - len(row) :] = 1
    out = native(ids, attn=PaddedContext(mask))
    assert torch.isfinite(out).all()  # padded queries must not produce NaN
    for i, row in enumerate(rows):
        alone = native(row[None])
        assert (out[i, seq_len - len(row) :] - alone[0]).abs().max().item() <= 1e-5


@torch.no_grad()
def test_packed_context_equals_sequences_alone(family_pair):
    _, _, _, native = family_pair
    seqs = [_ids(1, n, seed=20 + i)[0] for i, n in enumerate([5, 9, 4])]
    packed = torch.cat(seqs)[None]
    out = native(packed, attn=PackedContext([len(s) for s in seqs]))
    start = 0
    for s in seqs:
        alone = native(s[None])[0]
        assert (out[0, start : start + len(s)] - alone).abs().max().item() <= 1e-5
        start += len(s)


@torch.no_grad()
def test_explicit_positions_override_context(family_pair):
    _, _, _, native = family_pair
    ids = _ids(1, 8)
    shifted = torch.arange(8)[None]
    assert torch.equal(native(ids, positions=shifted), native(ids, attn=CausalContext()))
    assert not torch.allclose(native(ids, positions=shifted + 5), native(ids))


@torch.no_grad()
def test_sharded_save_reloads_in_transformers(family_pair, tmp_path):
    from transformers import AutoModelForCausalLM

    _, _, _, native = family_pair
    out = save_model(native, tmp_path / "ckpt", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / f).is_file() for f in shards)
    assert not (out / "model.safetensors").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = _ids(2, 16)
    assert (reloaded(ids).logits - native(ids)).abs().max().item() <= TOL
    again = load_model(out)
    assert all(
        torch.equal(a, b)
        for a, b in zip(again.state_dict().values(), native.state_dict().values(), strict=True)
    )


def test_qwen3_uses_explicit_head_dim(tmp_path):
    _tiny_hf("qwen3", tmp_path)
    native = load_model(tmp_path)
    assert native.args.head_dim == 32 and native.args.qk_norm
    assert native.model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 64)


def test_llama3_scaling_changes_frequencies():
    args = ModelArgs.from_hf_config(_hf_config("llama3-rope").to_dict())
    assert args.rope_scaling.rope_type == "llama3"
    plain = args.replace(rope_scaling=type(args.rope_scaling)())
    scaled, unscaled = rope_inv_freq(args, "cpu"), rope_inv_freq(plain, "cpu")
    assert not torch.allclose(scaled, unscaled)
    assert torch.equal(scaled[0], unscaled[0])  # the highest frequency is left alone


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_embeddings(tmp_path, tied):
    _tiny_hf("llama", tmp_path / "src", tie_word_embeddings=tied)
    model = load_model(tmp_path / "src")
    same = model.lm_head.weight is model.model.embed_tokens.weight
    assert same == tied
    out = save_model(model, tmp_path / "out")
    assert ("lm_head.weight" in load_file(out / "model.safetensors")) == (not tied)
    reloaded = load_model(out)
    ids = _ids(1, 6)
    assert torch.equal(reloaded(ids), model(ids))


def test_bf16_load_and_device(tmp_path):
    _tiny_hf("qwen2", tmp_path)
    model = load_model(tmp_path, dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model(_ids(1, 5)).dtype == torch.bfloat16
    out = save_model(model, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    _tiny_hf("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointMismatch) as err:
        load_model(tmp_path)
    msg = str(err.value)
    assert "config/checkpoint mismatch" in msg and "model.safetensors" in msg
    assert "model.layers.0.mlp.gate_proj.weight" in msg and "(128, 64)" in msg and "(96, 64)" in msg


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    _tiny_hf("llama", tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(
        CheckpointMismatch, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*missing"
    ):
        load_model(tmp_path)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(128, 64)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatch, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        load_model(tmp_path)


def test_untied_checkpoint_without_head_is_an_error(tmp_path):
    _tiny_hf("llama", tmp_path, tie_word_embeddings=False)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatch, match="lm_head.weight"):
        load_model(tmp_path)


def test_missing_folder_and_config_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty.*config\.json"):
        load_model(tmp_path / "empty")


def test_failed_save_keeps_previous_checkpoint(tmp_path):
    _tiny_hf("llama", tmp_path / "src")
    model = load_model(tmp_path / "src")
    target = save_model(model, tmp_path / "ckpt")
    with pytest.raises(TypeError):
        save_model(torch.nn.Linear(2, 2), target)
    assert load_model(target) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "src"]  # no partial folders left


def test_save_copies_tokenizer_files(tiny_model_dir, tmp_path):
    model = load_model(tiny_model_dir)
    out = save_model(model, tmp_path / "with-tok", source=tiny_model_dir)
    tok = load_tokenizer(out)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False)
    assert text.startswith("<|im_start|>user")


def test_model_built_from_args_saves_a_transformers_config(tmp_path):
    from transformers import AutoModelForCausalLM

    args = ModelArgs.from_hf_config(_hf_config("qwen3").to_dict())
    torch.manual_seed(0)
    model = DecoderLM(args)
    _randomize(model)
    out = save_model(model, tmp_path / "fresh")
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = _ids(1, 12)
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max().item() <= TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, TOL), (torch.bfloat16, 0.1)])
@torch.no_grad()
def test_cuda_matches_transformers(tmp_path, dtype, tol):
    from transformers import AutoModelForCausalLM

    _tiny_hf("qwen3", tmp_path)
    native = load_model(tmp_path, dtype=dtype, device="cuda")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).to("cuda").eval()
    ids = _ids(3, 40).cuda()
    diff = (native(ids).float() - hf(ids).logits.float()).abs().max().item()
    print(f"\n[max-abs-diff] qwen3 cuda {dtype}: {diff:.3e}")
    assert diff <= tol
    mask = torch.ones_like(ids)
    mask[0, :10] = 0
    assert torch.isfinite(native(ids, attn=PaddedContext(mask))).all()


def test_save_over_existing_checkpoint_replaces_it(tmp_path):
    _tiny_hf("llama", tmp_path / "src")
    model = load_model(tmp_path / "src")
    target = save_model(model, tmp_path / "ckpt", max_shard_bytes=40_000)
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)
    save_model(model, target)  # unsharded this time: no stale shard or index may survive
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(load_model(target).model.norm.weight, model.model.norm.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "src"]
