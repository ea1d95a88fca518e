"""ModelArgs parsing: every supported field, both config generations, and the clear refusals."""

from __future__ import annotations

import pytest

from noria.models import NATIVE_FAMILIES, ModelArgs, load_model

BASE = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def _cfg(model_type: str, **extra) -> dict:
    return {"model_type": model_type, **BASE, **extra}


def test_native_families():
    assert NATIVE_FAMILIES == ("llama", "qwen2", "qwen3", "qwen3_moe")


def test_unknown_model_type_gives_none():
    assert ModelArgs.from_hf_config(_cfg("gpt2")) is None


def test_llama_defaults_and_biases():
    args = ModelArgs.from_hf_config(
        _cfg("llama", attention_bias=True, mlp_bias=True, eos_token_id=[2, 7])
    )
    assert (args.head_dim, args.num_kv_heads, args.rope_theta) == (16, 4, 10000.0)
    assert args.qkv_bias and args.o_bias and args.mlp_bias and not args.qk_norm
    assert args.eos_token_ids == (2, 7) and not args.tie_word_embeddings


def test_qwen2_has_qkv_bias_without_o_bias():
    args = ModelArgs.from_hf_config(
        _cfg("qwen2", attention_bias=False, use_sliding_window=False, sliding_window=4096)
    )
    assert args.qkv_bias and not args.o_bias and not args.mlp_bias


def test_qwen3_qk_norm_and_head_dim():
    args = ModelArgs.from_hf_config(_cfg("qwen3", head_dim=40, num_key_value_heads=2))
    assert args.qk_norm and args.head_dim == 40 and args.num_kv_heads == 2
    # transformers' Qwen3Config default when head_dim is absent is 128, not hidden / heads.
    assert ModelArgs.from_hf_config(_cfg("qwen3")).head_dim == 128


def test_transformers4_rope_keys():
    cfg = _cfg("llama", rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    args = ModelArgs.from_hf_config(cfg)
    assert args.rope_theta == 500000.0
    assert (args.rope_scaling.rope_type, args.rope_scaling.factor) == ("linear", 2.0)


def test_transformers5_rope_parameters_llama3():
    rope = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }
    args = ModelArgs.from_hf_config(
        _cfg("llama", rope_parameters=rope, max_position_embeddings=4096)
    )
    assert args.rope_theta == 5e5
    # Without original_max_position_embeddings transformers falls back to max_position_embeddings.
    assert args.rope_scaling.original_max_position_embeddings == 4096


def test_unsupported_rope_type_names_the_field():
    cfg = _cfg("qwen2", rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})
    with pytest.raises(ValueError, match=r"rope_parameters.*yarn"):
        ModelArgs.from_hf_config(cfg)
    with pytest.raises(ValueError, match=r"rope_scaling.*dynamic"):
        ModelArgs.from_hf_config(_cfg("llama", rope_scaling={"type": "dynamic", "factor": 2.0}))


def test_enabled_sliding_window_is_refused():
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelArgs.from_hf_config(_cfg("qwen2", use_sliding_window=True, sliding_window=128))
    layer_types = ["full_attention", "sliding_attention"]
    with pytest.raises(ValueError, match="layer_types"):
        ModelArgs.from_hf_config(_cfg("qwen3", use_sliding_window=True, layer_types=layer_types))
    # Enabled but applied to no layer (max_window_layers >= layers): same model, accepted.
    full = ["full_attention", "full_attention"]
    assert (
        ModelArgs.from_hf_config(_cfg("qwen2", use_sliding_window=True, layer_types=full))
        is not None
    )


def test_other_activation_is_refused():
    with pytest.raises(ValueError, match="hidden_act"):
        ModelArgs.from_hf_config(_cfg("llama", hidden_act="gelu"))


@pytest.mark.parametrize("model_type", NATIVE_FAMILIES)
def test_to_hf_config_round_trips(model_type):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    args = ModelArgs.from_hf_config(
        _cfg(model_type, rope_parameters=rope, head_dim=8, tie_word_embeddings=True)
    )
    assert ModelArgs.from_hf_config(args.to_hf_config()) == args


def test_native_impl_on_unsupported_type_names_it(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(_cfg("gpt_neox")))
    with pytest.raises(ValueError, match=r"gpt_neox.*llama, qwen2, qwen3"):
        load_model(tmp_path, impl="native")
    with pytest.raises(ValueError, match="impl must be"):
        load_model(tmp_path, impl="vllm")
