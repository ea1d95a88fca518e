"""Model hyper-parameters of the native decoder families, read from a HF ``config.json``.

This module owns the translation from a Hugging Face config dict (as written by transformers 4.x
or 5.x) to :class:`ModelArgs`, the one typed record the native decoder is built from. Data moves
one way: ``config.json`` -> dict -> ``ModelArgs.from_hf_config`` -> ``DecoderLM(args)``.

What it guarantees: a config of a supported family either parses into arguments that reproduce
transformers' forward pass, or raises a ``ValueError`` that names the field it cannot honour
(sliding window, an unsupported RoPE type, an activation other than SiLU). It never guesses.
A ``model_type`` outside :data:`NATIVE_FAMILIES` gives ``None``: the caller falls back to the
transformers wrapper (``noria.models.hf``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from noria.errors import NoriaError


class UnsupportedModel(NoriaError):
    """A config.json asks for something the native decoder does not implement (the message names the field)."""

NATIVE_FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3_moe")
"""HF ``model_type`` values that the native decoder implements."""

VISION_FAMILIES: tuple[str, ...] = ("idefics3",)
"""HF ``model_type`` values of the native vision-language family (``noria.models.vlm``): a vision
tower in front of a native decoder, whose ``ModelArgs`` come from :func:`decoder_config`."""

ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")
"""RoPE variants the native decoder implements (HF ``rope_type`` names)."""

# Defaults that transformers' own config classes apply when a key is absent from config.json.
# Matching them is what makes a sparse config.json load to the same model in both stacks.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "head_dim": None},
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "head_dim": None},
    "qwen3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "head_dim": 128},
    "qwen3_moe": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "head_dim": None},
}
# Qwen3MoeConfig's defaults for its mixture-of-experts fields.
_MOE_DEFAULTS: dict[str, Any] = {
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "router_aux_loss_coef": 0.001,
}
_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE inverse frequencies are rescaled for long context (HF ``rope_parameters``)."""

    rope_type: str = "default"
    """``default`` (none), ``linear`` (divide every frequency by ``factor``) or ``llama3``."""
    factor: float = 1.0
    """Context-extension factor (``linear`` and ``llama3``)."""
    low_freq_factor: float = 1.0
    """``llama3``: wavelengths above ``original_max_position_embeddings / low_freq_factor`` are
    divided by ``factor``."""
    high_freq_factor: float = 4.0
    """``llama3``: wavelengths below ``original_max_position_embeddings / high_freq_factor`` are
    kept; those in between are interpolated."""
    original_max_position_embeddings: int = 8192
    """``llama3``: the context length the model was pre-trained with."""


@dataclass(frozen=True)
class MoeArgs:
    """Mixture-of-experts layers of a Qwen3-MoE model (HF ``Qwen3MoeConfig`` fields)."""

    num_experts: int
    """Experts per MoE layer (HF ``num_experts``; transformers 5 also writes ``num_local_experts``)."""
    top_k: int
    """Experts each token is sent to (HF ``num_experts_per_tok``)."""
    intermediate_size: int
    """Width of one expert's SwiGLU (HF ``moe_intermediate_size``); dense layers use
    ``ModelArgs.intermediate_size``."""
    norm_topk_prob: bool
    """Renormalise the top-k softmax probabilities to sum to 1 (Qwen3-30B-A3B: true)."""
    decoder_sparse_step: int
    """Layer i is MoE when ``(i + 1) % decoder_sparse_step == 0`` (and not in ``mlp_only_layers``)."""
    mlp_only_layers: tuple[int, ...]
    """Layers that keep a dense MLP whatever ``decoder_sparse_step`` says."""
    router_aux_loss_coef: float
    """The config's load-balancing coefficient, kept for the round trip to ``config.json``; the
    trainer's own weight is ``train.loss.router_aux_coef``."""

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` has an MoE block (transformers' rule)."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


@dataclass(frozen=True)
class ModelArgs:
    """Shape and numerics of one decoder-only transformer (Llama, Qwen2, Qwen3 dense, Qwen3-MoE)."""

    model_type: str
    """HF family name, one of :data:`NATIVE_FAMILIES`."""
    vocab_size: int
    """Rows of the embedding and of the output head."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_layers: int
    """Number of decoder blocks (HF ``num_hidden_layers``)."""
    num_heads: int
    """Query heads per layer (HF ``num_attention_heads``)."""
    num_kv_heads: int
    """Key/value heads per layer; fewer than ``num_heads`` means grouped-query attention."""
    head_dim: int
    """Width of one head; explicit in the config or ``hidden_size // num_heads``."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm (blocks, final norm, q/k norms)."""
    rope_theta: float
    """RoPE base wavelength."""
    rope_scaling: RopeScaling
    """RoPE frequency rescaling; ``rope_type == "default"`` means none."""
    qkv_bias: bool
    """Bias on the q, k and v projections (Qwen2 always; Llama/Qwen3 ``attention_bias``)."""
    o_bias: bool
    """Bias on the output projection (Llama/Qwen3 ``attention_bias``; never for Qwen2)."""
    mlp_bias: bool
    """Bias on the three MLP projections (Llama ``mlp_bias``)."""
    qk_norm: bool
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""
    tie_word_embeddings: bool
    """The output head shares the embedding matrix; ``lm_head.weight`` may be absent on disk."""
    max_position_embeddings: int
    """Longest context the config declares (not enforced by the decoder)."""
    bos_token_id: int | None
    """Beginning-of-sequence id, if the config names one."""
    eos_token_ids: tuple[int, ...]
    """End-of-sequence ids (HF allows an int or a list); empty if none."""
    moe: MoeArgs | None = None
    """Mixture-of-experts layers (``qwen3_moe``); None for dense families."""

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the decoder layers that have an MoE block, in order (empty when dense)."""
        if self.moe is None:
            return ()
        return tuple(i for i in range(self.num_layers) if self.moe.is_sparse(i))

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> ModelArgs | None:
        """Parse a HF ``config.json`` dict; ``None`` when its ``model_type`` is not native."""
        model_type = cfg.get("model_type")
        if model_type not in NATIVE_FAMILIES:
            return None
        defaults = _FAMILY_DEFAULTS[model_type]
        _check_activation(cfg)
        _check_sliding_window(cfg)
        heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim", defaults["head_dim"]) or int(cfg["hidden_size"]) // heads
        theta, scaling = _parse_rope(cfg)
        qkv_bias, o_bias = _attention_biases(model_type, cfg)
        return ModelArgs(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", defaults["rms_norm_eps"])),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(
                cfg.get("max_position_embeddings", defaults["max_position_embeddings"])
            ),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
            moe=_parse_moe(cfg, int(cfg["num_hidden_layers"])) if model_type == "qwen3_moe" else None,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A transformers ``config.json`` dict describing these arguments (inverse of parsing)."""
        cfg: dict[str, Any] = {
            "model_type": self.model_type,
            "architectures": [_ARCHITECTURES[self.model_type]],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,  # transformers 4.x reads it here
            "rope_parameters": _rope_parameters(self.rope_theta, self.rope_scaling),
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids)
            if len(self.eos_token_ids) != 1
            else self.eos_token_ids[0],
        }
        if self.model_type != "qwen2":
            cfg["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            cfg["mlp_bias"] = self.mlp_bias
        if self.moe is not None:
            cfg.update(_moe_hf_fields(self.moe))
        return cfg

    def replace(self, **changes: Any) -> ModelArgs:
        """A copy with some fields changed (tests and tools build variants this way)."""
        return dataclasses.replace(self, **changes)


_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def _parse_moe(cfg: dict[str, Any], num_layers: int) -> MoeArgs:
    def get(key: str) -> Any:
        return cfg.get(key, _MOE_DEFAULTS[key])

    # transformers 5 writes num_experts as num_local_experts (an attribute_map alias).
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", _MOE_DEFAULTS["num_experts"])))
    moe = MoeArgs(
        num_experts=experts,
        top_k=int(get("num_experts_per_tok")),
        intermediate_size=int(get("moe_intermediate_size")),
        norm_topk_prob=bool(get("norm_topk_prob")),
        decoder_sparse_step=int(get("decoder_sparse_step")),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        router_aux_loss_coef=float(get("router_aux_loss_coef")),
    )
    _check_moe(moe, num_layers)
    return moe


def _check_moe(moe: MoeArgs, num_layers: int) -> None:
    if moe.decoder_sparse_step < 1:
        raise UnsupportedModel(f"config field 'decoder_sparse_step' must be >= 1, got {moe.decoder_sparse_step}")
    if moe.num_experts < 0 or (moe.num_experts > 0 and not 1 <= moe.top_k <= moe.num_experts):
        raise UnsupportedModel(
            f"config fields 'num_experts_per_tok' ({moe.top_k}) and 'num_experts' ({moe.num_experts}): "
            "need 1 <= num_experts_per_tok <= num_experts"
        )
    outside = [i for i in moe.mlp_only_layers if not 0 <= i < num_layers]
    if outside:
        raise UnsupportedModel(
            f"config field 'mlp_only_layers' names layers {outside} outside 0..{num_layers - 1}"
        )


def _moe_hf_fields(moe: MoeArgs) -> dict[str, Any]:
    return {
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.intermediate_size,
        "norm_topk_prob": moe.norm_topk_prob,
        "decoder_sparse_step": moe.decoder_sparse_step,
        "mlp_only_layers": list(moe.mlp_only_layers),
        "router_aux_loss_coef": moe.router_aux_loss_coef,
    }


def _rope_parameters(theta: float, scaling: RopeScaling) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": scaling.rope_type, "rope_theta": theta}
    if scaling.rope_type != "default":
        params["factor"] = scaling.factor
    if scaling.rope_type == "llama3":
        params["low_freq_factor"] = scaling.low_freq_factor
        params["high_freq_factor"] = scaling.high_freq_factor
        params["original_max_position_embeddings"] = scaling.original_max_position_embeddings
    return params


def _check_activation(cfg: dict[str, Any]) -> None:
    # The MLP is hard-wired SwiGLU; another activation would silently compute a different model.
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(
            f"config field 'hidden_act' is {act!r}; the native decoder supports only 'silu'"
        )


def _check_sliding_window(cfg: dict[str, Any]) -> None:
    # A disabled window is common in Qwen configs and harmless; an active one changes attention.
    layer_types = cfg.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise UnsupportedModel(
            f"config field 'layer_types' contains {sorted(set(layer_types))}: sliding-window "
            "attention is not supported by the native decoder (use impl='hf')"
        )
    if cfg.get("use_sliding_window", False) and not layer_types:
        raise UnsupportedModel(
            "config field 'use_sliding_window' is true: sliding-window attention is not supported "
            "by the native decoder (use impl='hf')"
        )


def _attention_biases(model_type: str, cfg: dict[str, Any]) -> tuple[bool, bool]:
    # Qwen2 hard-codes q/k/v bias without o bias; the others use one flag for all four.
    if model_type == "qwen2":
        return True, False
    bias = bool(cfg.get("attention_bias", False))
    return bias, bias


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling]:
    """RoPE theta and scaling from transformers-5 ``rope_parameters`` or 4.x top-level keys."""
    params = dict(cfg.get("rope_parameters") or {})
    field = "rope_parameters"
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
        field = "rope_scaling"
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModel(f"config field '{field}' is nested per layer type; not supported natively")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", _DEFAULT_ROPE_THETA)))
    # 4.x wrote the type under "type"; transformers 5 under "rope_type".
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModel(
            f"config field '{field}' has rope_type {rope_type!r}; "
            f"supported: {', '.join(ROPE_TYPES)}"
        )
    if partial != 1.0:
        raise UnsupportedModel(
            f"config field 'partial_rotary_factor' is {partial}; only 1.0 is supported"
        )
    return theta, _rope_scaling(rope_type, params, cfg)


def _rope_scaling(rope_type: str, params: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling:
    if rope_type == "default":
        return RopeScaling()
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=float(params["factor"]))
    # Same precedence as transformers: a top-level value (Phi-3 style) wins, then the rope dict,
    # then max_position_embeddings.
    original = cfg.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings", cfg.get("max_position_embeddings")
    )
    return RopeScaling(
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(original),
    )


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def decoder_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config dict the native decoder is built from: ``cfg`` itself, or for a vision family its
    language model's (HF ``text_config``; transformers ties the head by the top-level
    ``tie_word_embeddings``, so that value is the one kept)."""
    if cfg.get("model_type") not in VISION_FAMILIES:
        return cfg
    text = dict(cfg.get("text_config") or {})
    text.setdefault("model_type", "llama")
    text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
    if text.get("eos_token_id") is None and cfg.get("eos_token_id") is not None:
        text["eos_token_id"] = cfg["eos_token_id"]
    if text["model_type"] not in NATIVE_FAMILIES:
        raise UnsupportedModel(
            f"config field 'text_config.model_type' is {text['model_type']!r}; the native "
            f"{cfg['model_type']} family needs a native language model ({', '.join(NATIVE_FAMILIES)})"
        )
    return text
