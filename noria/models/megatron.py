"""HF <-> Megatron-Core weight names and layouts of the native families (no megatron import here).

This module owns the translation between the state dict of a native model (:class:`DecoderLM`,
transformers' in-memory names: ``model.layers.3.self_attn.q_proj.weight``, stacked MoE experts)
and the state dict of megatron-core's ``GPTModel`` built with the local layer spec
(``decoder.layers.3.self_attention.linear_qkv.weight``), both unsharded, and the tensor-parallel
split of the Megatron tensors. Pure tensor reshapes: the CPU suite checks them without a GPU, and
the Megatron backend (``noria.train.megatron``) builds on them. Data moves::

    HF folder -> load_model -> DecoderLM.state_dict()  --to_megatron-->  full Megatron tensors
              --tp_shard(rank)--> this rank's GPTModel.load_state_dict
    GPTModel (each TP rank) --tp_gather--> full Megatron tensors --to_hf--> HF names, in HF order
              -> weight-sync buckets (noria.models.checkpoint.bucketize) or save_model

Layouts (Megatron's, as its ``SelfAttention`` and GLU ``MLP`` read them):

- ``linear_qkv`` [(Hq + 2 Hkv) * D, H]: per key/value group g, the group's Hq/Hkv query heads, then
  its key head, then its value head (so a dim-0 split by TP rank gives each rank whole groups).
- ``linear_fc1`` [2 I, H]: gate rows then up rows; under TP each rank holds its gate slice followed
  by its up slice (``tp_shard`` / ``tp_gather`` reorder them).
- MoE (``SequentialMLP``): ``mlp.router.weight`` [E, H] is HF's ``mlp.gate.weight``;
  ``mlp.experts.local_experts.{e}.linear_fc1.weight`` [2 I, H] is row e of HF's stacked
  ``gate_up_proj`` and ``linear_fc2.weight`` [H, I] row e of ``down_proj``. With expert
  parallelism a rank holds experts ``[ep_rank * E / ep, ...)`` numbered from 0 (``expert_slice``).
- A tied head (``tie_word_embeddings``) has no ``output_layer.weight``.

Not guaranteed: pipeline-parallel layer offsets (the backend refuses ``pp > 1``); the vocabulary
is padded to a multiple of the TP size by the caller, never here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import torch

from noria.models.config import ModelArgs

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MLAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Same tensor, renamed only: HF leaf -> Megatron leaf (inside one decoder layer).
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.o_proj.bias": "self_attention.linear_proj.bias",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "mlp.down_proj.bias": "mlp.linear_fc2.bias",
    "mlp.gate.weight": "mlp.router.weight",
}
_GLOBAL_RENAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}

COLUMN_PARALLEL = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
                   "word_embeddings.weight", "output_layer.weight")
"""Megatron tensors split on dim 0 across tensor-parallel ranks."""
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")
"""Megatron tensors with one row per vocabulary entry (padded to a multiple of the TP size in the model)."""
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")
"""Megatron tensors split on dim 1 across tensor-parallel ranks (their biases are replicated)."""


class ConversionError(ValueError):
    """A state dict does not hold what the model's arguments say it must (the message names the tensor)."""


def to_megatron(state: Mapping[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Native (HF-named) state dict -> unsharded Megatron GPTModel state dict (new tensors)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name in _GLOBAL_RENAMES:
            if name == "lm_head.weight" and args.tie_word_embeddings:
                continue
            out[_GLOBAL_RENAMES[name]] = t
            continue
        m = _LAYER.match(name)
        if m is None:
            raise ConversionError(f"no Megatron place for tensor {name!r}")
        layer, leaf = m.groups()
        prefix = f"decoder.layers.{layer}."
        if leaf in _LAYER_RENAMES:
            out[prefix + _LAYER_RENAMES[leaf]] = t
        elif leaf.startswith("self_attn.") and leaf.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
            if leaf.startswith("self_attn.q_proj"):
                kind = leaf.rsplit(".", 1)[1]
                out[prefix + f"self_attention.linear_qkv.{kind}"] = _fuse_qkv(state, f"model.layers.{layer}.self_attn", kind, args)
        elif leaf in ("mlp.gate_proj.weight", "mlp.gate_proj.bias"):
            kind = leaf.rsplit(".", 1)[1]
            out[prefix + f"mlp.linear_fc1.{kind}"] = torch.cat([t, _need(state, f"model.layers.{layer}.mlp.up_proj.{kind}")])
        elif leaf in ("mlp.up_proj.weight", "mlp.up_proj.bias"):
            continue  # fused with gate_proj above
        elif leaf in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            fc = "linear_fc1" if leaf.endswith("gate_up_proj") else "linear_fc2"
            for e in range(t.shape[0]):
                out[prefix + f"mlp.experts.local_experts.{e}.{fc}.weight"] = t[e]
        else:
            raise ConversionError(f"no Megatron place for tensor {name!r}")
    return out


def to_hf(state: Mapping[str, torch.Tensor], args: ModelArgs) -> Iterator[tuple[str, torch.Tensor]]:
    """Unsharded Megatron state dict -> (native HF name, tensor) pairs, layer by layer in the native
    model's state-dict order; the tied head is left out, as ``FSDPBackend`` streams it. Lazy: a
    layer's tensors are built only when the consumer reaches them."""
    yield "model.embed_tokens.weight", _need(state, "embedding.word_embeddings.weight")
    for i in range(args.num_layers):
        yield from _layer_to_hf(state, args, i)
    yield "model.norm.weight", _need(state, "decoder.final_layernorm.weight")
    if not args.tie_word_embeddings:
        yield "lm_head.weight", _need(state, "output_layer.weight")


def _layer_to_hf(state: Mapping[str, torch.Tensor], args: ModelArgs, i: int) -> Iterator[tuple[str, torch.Tensor]]:
    p, hp = f"decoder.layers.{i}.", f"model.layers.{i}."
    yield hp + "input_layernorm.weight", _need(state, p + "input_layernorm.weight")
    kinds = ("weight", "bias") if args.qkv_bias else ("weight",)
    qkv = {kind: _split_qkv(_need(state, p + f"self_attention.linear_qkv.{kind}"), args) for kind in kinds}
    for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
        for kind in kinds:
            yield hp + f"self_attn.{proj}.{kind}", qkv[kind][j]
    yield hp + "self_attn.o_proj.weight", _need(state, p + "self_attention.linear_proj.weight")
    if args.o_bias:
        yield hp + "self_attn.o_proj.bias", _need(state, p + "self_attention.linear_proj.bias")
    if args.qk_norm:
        yield hp + "self_attn.q_norm.weight", _need(state, p + "self_attention.q_layernorm.weight")
        yield hp + "self_attn.k_norm.weight", _need(state, p + "self_attention.k_layernorm.weight")
    yield hp + "post_attention_layernorm.weight", _need(state, p + "pre_mlp_layernorm.weight")
    if args.moe is not None and i in args.moe_layers:
        yield hp + "mlp.gate.weight", _need(state, p + "mlp.router.weight")
        experts = range(args.moe.num_experts)
        yield hp + "mlp.experts.gate_up_proj", torch.stack([_need(state, p + f"mlp.experts.local_experts.{e}.linear_fc1.weight") for e in experts])
        yield hp + "mlp.experts.down_proj", torch.stack([_need(state, p + f"mlp.experts.local_experts.{e}.linear_fc2.weight") for e in experts])
    else:
        kinds = ("weight", "bias") if args.mlp_bias else ("weight",)
        fc1 = {kind: _need(state, p + f"mlp.linear_fc1.{kind}").chunk(2, dim=0) for kind in kinds}
        for j, proj in enumerate(("gate_proj", "up_proj")):
            for kind in kinds:
                yield hp + f"mlp.{proj}.{kind}", fc1[kind][j]
        yield hp + "mlp.down_proj.weight", _need(state, p + "mlp.linear_fc2.weight")
        if args.mlp_bias:
            yield hp + "mlp.down_proj.bias", _need(state, p + "mlp.linear_fc2.bias")


def _need(state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in state:
        raise ConversionError(f"tensor {name!r} is missing")
    return state[name]


def _fuse_qkv(state: Mapping[str, torch.Tensor], prefix: str, kind: str, args: ModelArgs) -> torch.Tensor:
    q, k, v = (_need(state, f"{prefix}.{n}_proj.{kind}") for n in ("q", "k", "v"))
    g, d = args.num_kv_heads, args.head_dim
    rest = q.shape[1:]
    q = q.reshape(g, args.num_heads // g, d, *rest)
    k, v = k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d, per = args.num_kv_heads, args.head_dim, args.num_heads // args.num_kv_heads
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, per + 2, d, *rest)
    q = grouped[:, :per].reshape(-1, *rest)
    k = grouped[:, per].reshape(-1, *rest)
    v = grouped[:, per + 1].reshape(-1, *rest)
    return q, k, v


def split_dim(name: str) -> int | None:
    """The dim a Megatron tensor is split on across tensor-parallel ranks (None: replicated)."""
    if name.endswith(COLUMN_PARALLEL) and ".router." not in name:
        return 0
    if name.endswith(ROW_PARALLEL):
        return 1
    return None


def _is_glu(name: str) -> bool:
    return name.endswith(("linear_fc1.weight", "linear_fc1.bias"))


def tp_shard(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Tensor-parallel rank ``rank``'s part of the unsharded Megatron tensor ``full``."""
    dim = split_dim(name)
    if dim is None or tp == 1:
        return full
    if _is_glu(name):  # [gate; up] -> this rank's [gate_r; up_r]
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    if full.shape[dim] % tp:
        raise ConversionError(f"{name}: dim {dim} of shape {tuple(full.shape)} does not split over {tp} TP ranks")
    return full.chunk(tp, dim=dim)[rank]


def tp_gather(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`tp_shard`: the unsharded tensor from every TP rank's part, in rank order."""
    dim = split_dim(name)
    if dim is None or len(parts) == 1:
        return parts[0]
    if _is_glu(name):
        gates, ups = zip(*(p.chunk(2, dim=0) for p in parts))
        return torch.cat([*gates, *ups])
    return torch.cat(parts, dim=dim)


def expert_slice(num_experts: int, ep: int, rank: int) -> range:
    """The global expert ids an expert-parallel rank holds (as its local experts 0, 1, ...)."""
    if num_experts % ep:
        raise ConversionError(f"{num_experts} experts do not split over {ep} expert-parallel ranks")
    per = num_experts // ep
    return range(rank * per, (rank + 1) * per)


_LOCAL_EXPERT = re.compile(r"^(?P<prefix>.*\.local_experts\.)(?P<e>\d+)(?P<rest>\..*)$")


def expert_to_global(name: str, first: int) -> str:
    """The global Megatron name of a rank's local expert tensor (its experts start at ``first``)."""
    m = _LOCAL_EXPERT.match(name)
    return name if m is None else f"{m['prefix']}{int(m['e']) + first}{m['rest']}"


def expert_to_local(name: str, experts: range) -> str | None:
    """The local name of a global expert tensor on the rank holding ``experts``, or None if another rank holds it."""
    m = _LOCAL_EXPERT.match(name)
    if m is None:
        return name
    e = int(m["e"])
    return f"{m['prefix']}{e - experts.start}{m['rest']}" if e in experts else None
