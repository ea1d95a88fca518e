"""A native family as megatron-core's ``GPTModel`` (local layer spec), and its packed forward.

This module owns everything that imports megatron-core: the availability check, the parallel
state, the ``TransformerConfig`` a :class:`ModelArgs` maps to, the layer spec, and the forward of a
packed batch to final hidden states. What it builds::

    ModelArgs + train.megatron -> TransformerConfig (RMSNorm, SwiGLU, GQA, RoPE, qk-norm, MoE router)
      -> get_gpt_layer_local_spec (no Transformer Engine), core attention = PackedCoreAttention
      -> GPTModel on the current CUDA device, weights copied in from the HF model
         (noria.models.megatron: names, QKV / GLU layouts, TP split)

Packed forward (``packed_hidden``): one row of sequences back to back in Megatron's THD layout
(``PackedSeqParams`` with the batch's ``cu_seqlens``): RoPE restarts at every sequence
(megatron-core's THD rotary path) and attention runs per sequence. Megatron's local
``DotProductAttention`` refuses packed sequences (only Transformer Engine's attention takes THD),
so the core attention is Noria's own ``PackedContext`` (per-sequence causal SDPA, grouped-query heads
never materialised) behind Megatron's core-attention interface: that is the one hand-written piece.

Numerics: parameters are in the compute dtype (bf16 by default) and the fp32 masters live in
Megatron's optimizer (``Float16OptimizerWithFloat16Params`` or the distributed optimizer); the
router's logits and softmax are fp32 (``moe_router_dtype``). Qwen3-MoE's ``norm_topk_prob`` maps to
``moe_router_pre_softmax=False`` (top-k, then softmax over the k: the renormalised weights) and its
absence to ``True`` (softmax over all experts, then top-k).

Not guaranteed: pipeline (``pp > 1``) and context (``cp > 1``) parallelism are refused at start;
experts run as megatron-core's ``SequentialMLP`` (a loop over experts: its grouped GEMMs need the
``grouped_gemm`` package or Transformer Engine, neither of which is a dependency here).
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from noria.config import TrainConfig
from noria.models import PackedContext
from noria.models.config import ModelArgs
from noria.models.megatron import VOCAB_ROWS, expert_to_local, tp_shard
from noria.train.backend import TrainError

MIN_VERSION = "0.16"
"""The megatron-core releases this code is written against (``pip install 'noria[megatron]'``)."""


class MegatronUnavailable(TrainError):
    """``train.backend: megatron`` cannot run here (no CUDA, or megatron-core is not installed)."""


def megatron_installed() -> bool:
    """Whether ``megatron.core`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


def require_megatron(cfg: TrainConfig) -> None:
    """Refuse, naming the cause, where the Megatron backend cannot run: CPU device, no CUDA, no megatron-core,
    or a parallel setting this backend does not run (pp, cp)."""
    if not cfg.device.startswith("cuda"):
        raise MegatronUnavailable(
            f"train.backend megatron runs on CUDA only, but train.device is {cfg.device!r}; use train.backend "
            "single or fsdp2 on the CPU"
        )
    if not megatron_installed():
        raise MegatronUnavailable(
            "train.backend megatron needs the megatron-core package, which is not installed: "
            f"pip install 'noria[megatron]' (megatron-core >= {MIN_VERSION})"
        )
    if not torch.cuda.is_available():
        raise MegatronUnavailable("train.backend megatron needs a CUDA GPU, and torch sees none here")
    m = cfg.megatron
    if m.pp > 1:
        raise MegatronUnavailable(f"train.megatron.pp is {m.pp}: pipeline parallelism is not implemented by this backend yet")
    if m.cp > 1:
        raise MegatronUnavailable(
            f"train.megatron.cp is {m.cp}: context parallelism needs Transformer Engine's attention, which the "
            "local layer spec does not use"
        )


def quiet_import():
    """Import megatron.core with its 'Transformer Engine / Apex not installed' warnings silenced
    (the local spec and torch's AdamW are the intended fallbacks here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
        import megatron.core  # noqa: F401
        from megatron.core.models.gpt import GPTModel  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: F401
        from megatron.core.optimizer import get_megatron_optimizer  # noqa: F401
        from megatron.core.transformer.moe import moe_utils
    # megatron-core 0.16 binds te_general_gemm only when Transformer Engine imports, yet its fp32 router
    # reads the name either way (NameError without TE); None selects its own torch.mm path.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def init_parallel(cfg: TrainConfig, seed: int) -> None:
    """torch.distributed (one rank if no launcher set it up) and megatron-core's parallel groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        from noria.net import free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        from noria.train.fsdp import init_distributed

        init_distributed(cfg.device)
    if dist.get_world_size() != cfg.world_size:
        raise TrainError(f"train.world_size is {cfg.world_size} but the process group has {dist.get_world_size()} ranks")
    m = cfg.megatron
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=m.tp, pipeline_model_parallel_size=m.pp, context_parallel_size=m.cp,
            expert_model_parallel_size=m.ep,
        )
    model_parallel_cuda_manual_seed(seed)


def transformer_config(args: ModelArgs, cfg: TrainConfig, dtype: torch.dtype, cpu: bool = False):
    """The megatron-core ``TransformerConfig`` of ``args`` with the parallel and memory settings of ``cfg``
    (``cpu``: parameters allocated on the CPU, for the conversion tests)."""
    from megatron.core.transformer import TransformerConfig

    if args.o_bias != args.mlp_bias:
        raise TrainError(
            f"{args.model_type}: attention output bias ({args.o_bias}) and MLP bias ({args.mlp_bias}) differ; "
            "megatron-core has one add_bias_linear for both"
        )
    m = cfg.megatron
    recompute = "full" if cfg.activation_checkpointing else m.recompute
    kw = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_heads,
        num_query_groups=args.num_kv_heads, kv_channels=args.head_dim, ffn_hidden_size=args.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=args.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=args.mlp_bias, add_qkv_bias=args.qkv_bias, qk_layernorm=args.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, tensor_model_parallel_size=m.tp, pipeline_model_parallel_size=m.pp,
        context_parallel_size=m.cp, expert_model_parallel_size=m.ep,
        perform_initialization=False, use_cpu_initialization=cpu,
        # No fused kernels: they need Apex or Transformer Engine.
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )
    if recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        kw.update(recompute_granularity="selective")
    if args.moe is not None:
        kw.update(moe_kwargs(args, cfg))
    return TransformerConfig(**kw)


def moe_kwargs(args: ModelArgs, cfg: TrainConfig) -> dict:
    """TransformerConfig fields of a Qwen3-MoE model (router, experts, which layers are sparse)."""
    moe = args.moe
    coef = cfg.loss.router_aux_coef
    return dict(
        num_moe_experts=moe.num_experts, moe_router_topk=moe.top_k, moe_ffn_hidden_size=moe.intermediate_size,
        moe_layer_freq=[1 if moe.is_sparse(i) else 0 for i in range(args.num_layers)],
        moe_router_pre_softmax=not moe.norm_topk_prob, moe_router_score_function="softmax", moe_router_dtype="fp32",
        # all-to-all moves tokens between expert-parallel ranks; with one, all-gather is the plain path
        moe_token_dispatcher_type="alltoall" if cfg.megatron.ep > 1 else "allgather", moe_grouped_gemm=False,
        moe_router_load_balancing_type="aux_loss" if coef > 0 else "none", moe_aux_loss_coeff=coef,
    )


def rope_kwargs(args: ModelArgs) -> dict:
    """GPTModel's RoPE arguments; a scaling megatron-core does not implement the same way is refused."""
    s = args.rope_scaling
    kw = dict(position_embedding_type="rope", rotary_base=int(args.rope_theta), rotary_percent=1.0)
    if s.rope_type == "default":
        return kw
    if s.rope_type == "linear":
        return {**kw, "seq_len_interpolation_factor": s.factor}
    # megatron-core's llama3 scaling hard-codes these three (Llama 3.1's values).
    if (s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings) == (1.0, 4.0, 8192):
        return {**kw, "rope_scaling": True, "rope_scaling_factor": s.factor}
    raise TrainError(f"{args.model_type}: llama3 RoPE scaling {s} differs from the one megatron-core implements")


class PackedCoreAttention(nn.Module):
    """Megatron's core-attention interface over Noria's per-sequence packed attention (THD layout):
    q [T, Hq, D], k / v [T, Hkv, D] after RoPE -> [T, Hq * D]; each sequence of
    ``packed_seq_params.cu_seqlens_q`` attends causally to itself only."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **_):
        super().__init__()
        self.config = config
        if softmax_scale is not None and abs(softmax_scale - config.kv_channels ** -0.5) > 1e-12:
            raise TrainError(f"PackedCoreAttention uses 1/sqrt(head_dim); got softmax_scale {softmax_scale}")

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None or query.dim() != 3:
            raise TrainError("the Megatron backend runs packed (THD) batches only")
        lens = torch.diff(packed_seq_params.cu_seqlens_q).tolist()
        out = PackedContext(lens).attend(0, query[None], key[None], value[None])[0]
        return out.reshape(out.shape[0], -1)


def block_spec(tcfg):
    """megatron-core's local (no Transformer Engine) decoder block spec for ``tcfg`` (dense or MoE, one
    spec per layer), every layer's core attention replaced by :class:`PackedCoreAttention`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=False, normalization="RMSNorm", qk_l2_norm=False)
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = PackedCoreAttention
    return spec


def padded_vocab(args: ModelArgs, tp: int) -> int:
    """The vocabulary rounded up to a multiple of the TP size (the head's extra rows are sliced off)."""
    return -(-args.vocab_size // tp) * tp


def build_gpt(args: ModelArgs, cfg: TrainConfig, dtype: torch.dtype, cpu: bool = False):
    """An uninitialised GPTModel for ``args`` on the current CUDA device, or the CPU (weights are copied in next)."""
    from megatron.core.models.gpt import GPTModel

    tcfg = transformer_config(args, cfg, dtype, cpu)
    spec = block_spec(tcfg)
    gpt = GPTModel(
        tcfg, spec, vocab_size=padded_vocab(args, cfg.megatron.tp), max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=args.tie_word_embeddings, **rope_kwargs(args),
    )
    # Some modules (torch's RMSNorm) are built on the CPU in fp32 whatever the config says; Megatron-LM moves
    # and casts the whole model the same way (Float16Module).
    return gpt.to(device="cpu" if cpu else torch.cuda.current_device(), dtype=dtype)


@torch.no_grad()
def load_weights(gpt: nn.Module, full: dict[str, torch.Tensor], args: ModelArgs, tp: int = 1, tp_rank: int = 0,
                 experts: range | None = None) -> None:
    """Copy this rank's slice of every unsharded Megatron tensor (``noria.models.megatron.to_megatron``)
    into ``gpt``'s parameters: TP rank ``tp_rank`` of ``tp``, the global ``experts`` this rank holds.
    Every parameter must be filled, each with its exact shape (TrainError naming the tensor)."""
    params = dict(gpt.named_parameters())
    filled = set()
    for name, t in full.items():
        local = name if experts is None else expert_to_local(name, experts)
        if local is None:
            continue  # another expert-parallel rank's expert
        if name in VOCAB_ROWS:
            t = torch.cat([t, t.new_zeros(padded_vocab(args, tp) - t.shape[0], t.shape[1])])
        part = tp_shard(name, t, tp, tp_rank)
        if local not in params:
            raise TrainError(f"the Megatron model has no parameter {local!r} (converted from {name!r})")
        if tuple(params[local].shape) != tuple(part.shape):
            raise TrainError(f"{local}: Megatron shape {tuple(params[local].shape)}, converted {tuple(part.shape)}")
        params[local].copy_(part)
        filled.add(local)
    if missing := sorted(set(params) - filled):
        raise TrainError(f"Megatron parameters left without weights: {missing[:5]}")


def packed_params(cu_seqlens: torch.Tensor):
    """``PackedSeqParams`` (THD) of a packed row with sequence boundaries ``cu_seqlens``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens.to(torch.int32)
    longest = int(torch.diff(cu).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest)


def packed_hidden(gpt, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Final hidden states [N, H] (after the final norm) of a packed row of N tokens."""
    psp = packed_params(cu_seqlens)
    pre = gpt._preprocess(input_ids=input_ids[None], position_ids=None, decoder_input=None, inference_context=None,
                          packed_seq_params=psp)
    decoder_input, rotary, cos, sin, offset = pre[:5]
    hidden = gpt.decoder(hidden_states=decoder_input, attention_mask=None, rotary_pos_emb=rotary,
                         rotary_pos_cos=cos, rotary_pos_sin=sin, packed_seq_params=psp, sequence_len_offset=offset)
    return hidden[:, 0]


def head_logits(gpt, hidden: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits [n, vocab] of hidden states [n, H]: the output layer gathered over TP ranks, padding rows cut."""
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    logits, _ = gpt.output_layer(hidden[:, None], weight=weight, runtime_gather_output=True)
    return logits[:, 0, :vocab]
