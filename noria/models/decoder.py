"""The native decoder-only transformer: Llama, Qwen2, Qwen3 dense and Qwen3-MoE in one class.

:class:`DecoderLM` is the single model definition that the rollout engine and the trainer both
run, which is what makes their logprobs comparable (bitwise in deterministic mode). Per layer::

    x -> RMSNorm -> q,k,v proj (+bias) -> [q/k RMSNorm] -> RoPE -> ctx.attend -> o proj -> + x
      -> RMSNorm -> SwiGLU MLP (MoE layers: noria.models.moe.SparseMoeBlock) -> + x

Parameter names equal transformers' names (``model.embed_tokens.weight``,
``model.layers.0.self_attn.q_proj.weight``, ..., ``lm_head.weight``), so HF state dicts map 1:1.

What this module does NOT own: who attends to whom. Attention goes through an
:class:`~noria.models.attention.AttentionContext` passed to ``forward``; the default is plain
causal attention per row. There is deliberately no KV cache here: the rollout engine implements
its own context over a paged KV cache (it writes k/v into its blocks inside ``attend``), and the
trainer passes packed or padded contexts. Keeping the cache out keeps this file the same for
both, and keeps one code path for the numerics.

Numerics follow transformers exactly (RMSNorm in fp32 then cast back before the weight; RoPE
tables computed in fp32 and cast to the activation dtype), so fp32 logits agree to ~1e-5 and bf16
runs see the same rounding points.

Exact numerics (:meth:`DecoderLM.set_exact_numerics`, the deterministic mode of engine and trainer,
bf16 on CPU): every op must give a token the same bits whatever else shares the call, so that the
engine (one decode token, prefill chunks cut anywhere, other requests alongside) and the trainer
(whole packed sequences) compute the same numbers. Norms, RoPE, SiLU, residual adds, embedding
lookups and log-softmax do that as they are (measured: any number of rows). ``F.linear`` does not
(see :data:`DETERMINISTIC_ROWS`), so in exact mode the linear layers compute through
:func:`row_chunked_linear`, and every module computes in one dtype from casts of its parameters
(the trainer keeps fp32 masters; autocast would keep an fp32 residual stream the engine does not
have). Attention is the context's: ``attention.exact_attention`` in both deterministic contexts.
On CUDA (with Triton) linears, norms and that attention run the fixed-order kernels of
``noria.models.exact_cuda`` instead (cuBLAS and torch's CUDA reductions are not batch-invariant).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from noria.models import exact_cuda
from noria.models.attention import AttentionContext, CausalContext
from noria.models.config import ModelArgs, RopeScaling


DETERMINISTIC_ROWS = 24
"""Rows of every matmul of :func:`row_chunked_linear` (the last chunk is zero-padded to it).
Measured (torch 2.13; ``tests/engine/test_exact_agreement.py``): a 2-D matmul of one fixed shape gives a
row the same bits wherever it sits and whatever the other rows hold, in bf16 and fp32, on AVX-512
(oneDNN, MKL) and on AVX2 (torch's bf16 fallback, MKL). The number of rows is what changes a row's
bits: MKL's fp32 kernels differ from 2 rows on, oneDNN's bf16 ones above 32 (a 3-D input from 18),
so every call gets exactly this many. Why 24 and not 32: on an Intel Xeon (AMX) acting as AVX2,
MKL's fp32 kernel works in tiles of 6 rows and gives the 2 rows left over from 32 other bits (rows
30 and 31); 24 is a whole number of 4-, 6-, 8- and 12-row tiles and stays under oneDNN's 32."""


def row_chunked_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, rows: int = DETERMINISTIC_ROWS
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as 2-D matmuls of exactly ``rows`` rows of x (the last chunk
    zero-padded), so that a row's bits do not depend on how many rows share the call; the backward
    is one matmul per gradient."""
    return _RowChunkedLinear.apply(x, weight, bias, rows)


class _RowChunkedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, rows):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        flat = x.reshape(-1, x.shape[-1])
        if flat.is_cuda and exact_cuda.available():  # cuBLAS is not batch-invariant: fixed-tile Triton
            return exact_cuda.linear(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])
        out = flat.new_empty(len(flat), weight.shape[0])
        full = len(flat) - len(flat) % rows
        for i in range(0, full, rows):  # what 2-D F.linear runs, written in place
            _mm(flat[i : i + rows], weight, bias, out[i : i + rows])
        if full < len(flat):  # the tail, padded to the same shape
            tail = flat.new_zeros(rows, flat.shape[1])
            tail[: len(flat) - full] = flat[full:]
            out[full:] = _mm(tail, weight, bias, flat.new_empty(rows, weight.shape[0]))[: len(flat) - full]
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = (g @ weight).view_as(x) if ctx.needs_input_grad[0] else None
        grad_w = g.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def _mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    # Differentiable: gradients flow back to (fp32 master) parameters; a no-op in that dtype.
    return None if t is None else t.to(dtype)


def _drawn(weight: torch.Tensor) -> bool:
    """Whether a layer draws its random init: not on the meta device. A model built there
    (``load_native``) gets every weight from its checkpoint, and torch's meta kernels for the init
    draws are Python references that import ``torch._dynamo`` on first use: 0.6 s of every process
    start (py-spy of a one-step ``noria train`` of the tiny model: 0.59 of 4.8 s), for nothing."""
    return not weight.is_meta


class Linear(nn.Linear):
    """``nn.Linear``; in exact mode (``exact_dtype`` set) :func:`row_chunked_linear` in that dtype."""

    exact_dtype: torch.dtype | None = None
    fp8 = None
    """Set by the engine (``noria.engine.fp8``) on its own model: the FP8 matmul that replaces this
    layer's, called as ``fp8(x, bias)``. Never set on a model that trains."""

    def reset_parameters(self) -> None:
        if _drawn(self.weight):
            super().reset_parameters()

    lora = None
    """Set by the engine (``noria.engine.lora``) on its own model's targeted layers: called as
    ``lora(x, y)`` with this layer's output ``y``, it adds the LoRA deltas of the current batch's
    rows. Never set on a model that trains."""

    fake_quant = None
    """Set on the decoder blocks' layers of a trainer with ``train.qat`` and of a deterministic engine
    with integer weights (``noria.models.quantize.FakeQuant``): called on the weight, it gives the
    dequantized weight the quantized engine computes with, and its ``activations`` the input as that
    engine's matmul reads it (fp8 only; straight-through gradients)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base(x)
        return y if self.lora is None else self.lora(x, y)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return self.fp8(x, self.bias)
        weight = self.weight
        if self.fake_quant is not None:
            weight, x = self.fake_quant(weight), self.fake_quant.activations(x)
        if self.exact_dtype is None:
            return F.linear(x, weight, self.bias)
        return row_chunked_linear(x, _cast(weight, self.exact_dtype), _cast(self.bias, self.exact_dtype))


class Embedding(nn.Embedding):
    """``nn.Embedding``; in exact mode the lookup reads a cast of the table to ``exact_dtype``."""

    exact_dtype: torch.dtype | None = None

    def reset_parameters(self) -> None:
        if _drawn(self.weight):
            super().reset_parameters()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.exact_dtype is None:
            return super().forward(ids)
        return F.embedding(ids, _cast(self.weight, self.exact_dtype), self.padding_idx)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (no bias, no mean subtraction)."""

    exact_dtype: torch.dtype | None = None

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.exact_dtype is None else _cast(self.weight, self.exact_dtype)
        if self.exact_dtype is not None and x.is_cuda and exact_cuda.available():
            return exact_cuda.rms_norm(x, weight, self.eps)  # torch's row reduction is not batch-invariant there
        # The variance of bf16 activations loses too much in bf16; HF also casts back to the input
        # dtype *before* the weight, and we copy that order so bf16 rounding matches.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)


def rope_inv_freq(args: ModelArgs, device: torch.device) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim / 2] in fp32, with the config's scaling applied."""
    dim = args.head_dim
    inv_freq = 1.0 / (
        args.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float) / dim)
    )
    scaling = args.rope_scaling
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Llama 3.1 keeps short wavelengths, divides long ones by `factor`, and blends in between,
    # so local attention is untouched while the long range stretches to the new context.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_tables(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, T, head_dim] for the given positions, computed in fp32, cast to dtype."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] by position; HF's half-split layout (not interleaved pairs)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Projections, optional q/k norm and RoPE around a pluggable attention context."""

    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = args.head_dim
        q_dim, kv_dim = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.q_proj = Linear(args.hidden_size, q_dim, bias=args.qkv_bias)
        self.k_proj = Linear(args.hidden_size, kv_dim, bias=args.qkv_bias)
        self.v_proj = Linear(args.hidden_size, kv_dim, bias=args.qkv_bias)
        self.o_proj = Linear(q_dim, args.hidden_size, bias=args.o_bias)
        # Qwen3 normalises each head before RoPE, which keeps attention logits bounded.
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        heads_shape = (batch, seq_len, -1, self.head_dim)
        q = self.q_proj(x).view(heads_shape)
        k = self.k_proj(x).view(heads_shape)
        v = self.v_proj(x).view(heads_shape)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = ctx.attend(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(batch, seq_len, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One pre-norm block: attention then MLP (or, in a sparse layer of a MoE model, the
    ``noria.models.moe.SparseMoeBlock``), each added to the residual stream."""

    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.sparse = layer_idx in args.moe_layers
        if self.sparse:
            from noria.models.moe import SparseMoeBlock  # moe builds on this module's linears

            self.mlp = SparseMoeBlock(args, args.moe_layers.index(layer_idx))
        else:
            self.mlp = MLP(args)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext, routing=None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, routing) if self.sparse else self.mlp(h))


class DecoderModel(nn.Module):
    """Embedding, blocks and final norm: token ids -> normed hidden states (HF ``model.*``)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn: AttentionContext | None = None,
        routing=None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``inputs_embeds`` (HF's): the input as embeddings instead of ``embed_tokens(input_ids)``
        (a vision-language model's, with image features spliced in); ``input_ids`` still sets the shape."""
        ctx = attn if attn is not None else CausalContext()
        if positions is None:
            positions = ctx.positions(input_ids.shape[0], input_ids.shape[1], input_ids.device)
        if routing is not None:
            self._check_routing(routing, *input_ids.shape)
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        # Recomputed per call (a few hundred floats): no buffer to survive .to(dtype), meta
        # init or FSDP sharding, and it stays fp32 whatever the weights are.
        inv_freq = rope_inv_freq(self.args, input_ids.device)
        cos, sin = rope_tables(inv_freq, positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, ctx, routing)
        return self.norm(h)

    def _check_routing(self, routing, batch: int, seq_len: int) -> None:
        moe = self.args.moe
        if not self.args.moe_layers:
            raise ValueError(f"routing= given, but this {self.args.model_type} model has no MoE layer")
        routing.chosen.clear()
        routing.used.clear()
        routing.check_replay(batch, seq_len, len(self.args.moe_layers), moe.top_k, moe.num_experts)


class DecoderLM(nn.Module):
    """Decoder-only causal LM with HF parameter names; see the module docstring.

    ``hf_config`` is the ``config.json`` dict the model came from; ``save_model`` writes it back so
    a saved checkpoint loads in transformers unchanged.
    """

    def __init__(self, args: ModelArgs, hf_config: dict | None = None) -> None:
        super().__init__()
        self.args = args
        self.hf_config = dict(hf_config or {})
        self.model = DecoderModel(args)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()

    def set_exact_numerics(self, dtype: torch.dtype | None) -> None:
        """Exact mode (see the module docstring) computing in ``dtype``, or back to plain (None).
        Attention is not switched here: it is the context's (``PackedContext(deterministic=True)``,
        the engine's deterministic runner)."""
        for module in self.modules():
            # The MoE block and its router (noria.models.moe) carry the same switch.
            if isinstance(module, (Linear, Embedding, RMSNorm)) or hasattr(type(module), "exact_dtype"):
                module.exact_dtype = dtype

    def tie_weights(self) -> None:
        """Share the embedding with the head when the config says so (again after ``to_empty``,
        which replaces parameters one module at a time and so unties them)."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn: AttentionContext | None = None,
        routing=None,
    ) -> torch.Tensor:
        """Logits [B, T, V] in the model dtype for input_ids [B, T]. ``routing`` (a
        ``noria.models.moe.Routing``, MoE models only) replays given routes and records the
        routers' own."""
        return self.lm_head(self.model(input_ids, positions, attn, routing))

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn: AttentionContext | None = None,
        routing=None,
    ) -> torch.Tensor:
        """Final normed hidden states [B, T, H]; ``lm_head`` of these gives ``forward``'s logits.
        Trainers use this to compute logprobs in vocabulary chunks without [B, T, V] in memory."""
        return self.model(input_ids, positions, attn, routing)
