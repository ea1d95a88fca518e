"""The engine's fast forward of the native decoder on CPU: fused, prepacked linear layers.

The trainer and the engine share :class:`~noria.models.decoder.DecoderLM`; this module changes
nothing in it. It builds, next to the model, an engine-only copy of the linear weights in the form
oneDNN wants, and runs the same layer recipe as ``DecoderModel.forward`` with them:

- q/k/v become one matmul and gate/up one matmul (fewer, larger calls: the per-call cost
  dominates at decode sizes);
- every weight is reordered once into oneDNN's blocked layout (``mkldnn._reorder_linear_weight``)
  instead of at every ``F.linear`` call, which is what bf16 ``F.linear`` does on CPU.

- the residual add and the next RMSNorm, RoPE of q and k, and SwiGLU's ``silu(gate) * up`` are
  one C++ call each (``kernels/fused.cpp``; layers without q/k norms, i.e. Llama and Qwen2
  families) instead of ~30 small torch ops per layer, whose dispatch cost dominated decode steps.
  They round where the modules round; RoPE and SwiGLU give the modules' bits by construction, the
  norm's sum of squares runs in another order than torch's reduction (equal bits in every case the
  tests cover, not promised).

Otherwise norms, RoPE, SiLU, residual adds and the attention context are the model's own modules
and functions, called in the model's order, so the only numerical difference could come from the
matmuls. On this CPU (torch 2.13, bf16) the packed matmuls give the same bits as ``F.linear`` for
the row counts where they are used (``max_rows`` at most; larger steps, i.e. long prefills, run the
model's own modules), and tests check that the fast forward equals the plain one bitwise. That is
measured, not promised by oneDNN, so deterministic mode does not use this path at all: it runs the
exact modules the trainer runs.

Weights are copies: after every weight update the engine calls :meth:`FastDecoder.refresh_later`
(through ``ModelRunner.refresh_weights``, at the commit), otherwise the fast path would keep serving
the old weights. That drops the packed copies at once and packs the new weights on a background
thread (about 0.05-0.1 s for SmolLM2-135M on two Zen 4 cores, as much as the rest of a weight push);
until they are installed the runner runs the model's own modules, so the commit, and the push
waiting for it, do not wait for the packing, and the new weights are served from the next step on.
A pack made from parameters that changed again meanwhile is thrown away (a generation count), and
it reads the weight tensors the commit left (taken on the engine thread), never a parameter being
swapped.

Used only where it exists: CPU tensors in a dtype oneDNN packs on this CPU (:func:`supported`:
fp32 everywhere, bf16 where oneDNN has bf16 kernels — not on AVX2-only CPUs, where it refuses them).
Everywhere else (CUDA, bf16 on AVX2, deterministic mode) the runner calls the model. In fp32 the
packed oneDNN matmul and MKL's ``F.linear`` sum in different orders, so there the fast forward
equals the plain one to rounding, not bitwise (measured on AVX2: 0.6x the time of ``F.linear``
at 1 row, 0.44x at 8, 0.69x at 32 for a 576 -> 3072 layer).
``engine.quantization: int8 | int4``: the decoder blocks' four matmuls are the integer layers of
``noria.engine.quant`` instead of packed ones (the head stays packed, or plain where oneDNN does not
pack the dtype). Then every step runs these layers, long prefills included, and after an update
:meth:`FastDecoder.requantize` re-quantizes in place, synchronously, inside the commit: the model's
own (unquantized) modules never serve, so every token comes from the quantized policy.

Blocking: none beyond the forward itself. Memory: one extra copy of the linear weights.
Not guaranteed: bitwise the same tokens on both sides of an update in fp32, where the packed and the
plain matmuls round differently (a step right after an update may run either).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import NamedTuple

import torch
import torch.nn.functional as F

from noria import hardware, openmp
from noria.engine import kernels, quant
from noria.models.decoder import DecoderLM, DecoderLayer, apply_rope, rope_inv_freq, rope_tables

MAX_ROWS = 160
"""Steps with more tokens than this (long prefills) run the plain modules. Measured on SmolLM2
shapes: packed and ``F.linear`` agree bitwise up to ~190 rows and not from 192 (oneDNN switches
kernels), so the fast path stays below that with a margin."""


def supported(model: DecoderLM) -> bool:
    """True where the fast path exists: a dense CPU model whose dtype oneDNN's packed linears run
    here (fp32 on any x86 CPU; bf16 only where oneDNN has bf16 kernels, see ``noria.hardware``).
    MoE models run their own modules (their experts are not packed linears)."""
    first = next(model.parameters())
    return (
        not model.args.moe_layers
        and first.device.type == "cpu"
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hardware.packed_linear_ok(first.dtype)
    )


class PackedLinear:
    """``x @ cat(weights).T + cat(biases)``, with the concatenated weight reordered once for oneDNN."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None], batch_hint: int) -> None:
        with torch.no_grad():
            weight = torch.cat(weights) if len(weights) > 1 else weights[0]
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
            self.bias = torch.cat(biases) if all(b is not None for b in biases) else None
            if self.bias is None and any(b is not None for b in biases):
                # Mixed bias/no-bias groups (no supported family has one): zero-fill the missing.
                self.bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
        self.sizes = [w.shape[0] for w in weights]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [None], "")


Linears = list[tuple[list[torch.Tensor], list[torch.Tensor | None]]]
"""Weights and biases of one layer's qkv, o, gate_up and down groups (detached tensors)."""


def _layer_linears(layer: DecoderLayer) -> Linears:
    attn, mlp = layer.self_attn, layer.mlp
    groups = [[attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]]
    return [([m.weight.detach() for m in g], [None if m.bias is None else m.bias.detach() for m in g]) for g in groups]


class PlainLinear:
    """``F.linear`` over the concatenated weights: the head where oneDNN does not pack the dtype."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None], batch_hint: int = 0) -> None:
        self.weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        self.bias = biases[0] if len(biases) == 1 else None
        self.sizes = [w.shape[0] for w in weights]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _PackedLayer:
    """One decoder layer's four matmuls: qkv, o, gate_up, down (packed, or quantized)."""

    def __init__(self, linears: Linears, batch_hint: int, quantized: type | None = None) -> None:
        if quantized is None:
            self.qkv, self.o, self.gate_up, self.down = (PackedLinear(w, b, batch_hint) for w, b in linears)
        else:
            self.qkv, self.o, self.gate_up, self.down = (quantized(w, b) for w, b in linears)

    def update(self, linears: Linears) -> None:
        """Quantized layers: re-quantize new weights into the existing buffers."""
        for layer, (weights, biases) in zip((self.qkv, self.o, self.gate_up, self.down), linears):
            layer.update(weights, biases)


class Packed(NamedTuple):
    """The packed weights of one version of the parameters."""

    layers: list[_PackedLayer]
    head: PackedLinear


class FastDecoder:
    """The runner's forward over a :class:`DecoderLM` with packed weights; see the module docstring."""

    def __init__(self, model: DecoderLM, batch_hint: int = 64, max_rows: int = MAX_ROWS, quantization: str = "none") -> None:
        self.model = model
        self.batch_hint = batch_hint
        self.max_rows = max_rows
        self.quantized: type | None = quant.LAYERS[quantization] if quantization != "none" else None
        """The integer layer class of ``engine.quantization`` (``noria.engine.quant``), or None."""
        self._head = PackedLinear if hardware.packed_linear_ok(next(model.parameters()).dtype) else PlainLinear
        self.packed: Packed | None = None
        """The packed weights of the current parameters; None while they are being packed."""
        self._lock = threading.Lock()
        self._generation = 0
        self._packer: concurrent.futures.ThreadPoolExecutor | None = None  # one pack at a time, in order
        self._workers: concurrent.futures.ThreadPoolExecutor | None = None  # the layers of one pack
        self.refresh()

    def refresh(self) -> None:
        """Re-pack every weight from the model's current parameters, now (blocking)."""
        self.packed = None
        with self._lock:
            self._generation += 1
        self.packed = self._pack(self._weights())

    def refresh_later(self) -> concurrent.futures.Future:
        """The parameters changed: drop the packed copies now and pack the new weights on a
        background thread (call it on the thread that changes the parameters, between forwards);
        until they are installed, :attr:`packed` is None and the runner runs the model's modules."""
        weights = self._weights()  # the tensors as of now: a later swap of a parameter does not touch them
        with self._lock:
            self._generation += 1
            self.packed = None
            generation = self._generation
        if self._packer is None:
            self._packer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="noria-repack")
        return self._packer.submit(openmp.released(self._install), weights, generation)

    @torch.no_grad()
    def requantize(self) -> concurrent.futures.Future | None:
        """Quantized layers: re-quantize every layer from the model's current parameters into its
        buffers (in place), now, on the calling thread (the engine thread, inside the commit; the
        layers spread over the pack workers). The head, which is not quantized, runs ``F.linear``
        on the new weight at once and its packed copy is made on a background thread (as
        :meth:`refresh_later` does): the same weights either way, only the kernel differs."""
        layers, head = self._weights()
        bias = self.model.lm_head.bias
        head_bias = [None if bias is None else bias.detach()]
        with self._lock:
            self._generation += 1
            generation = self._generation
        list(self._pool().map(openmp.released(lambda pair: pair[0].update(pair[1])), zip(self.packed.layers, layers)))
        self.packed = Packed(self.packed.layers, PlainLinear([head], head_bias))
        if self._head is PlainLinear:  # oneDNN does not pack this dtype here: F.linear stays
            return None
        if self._packer is None:
            self._packer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="noria-repack")
        return self._packer.submit(openmp.released(self._install_head), head, head_bias, generation)

    def _install_head(self, head: torch.Tensor, bias: list[torch.Tensor | None], generation: int) -> None:
        if generation != self._generation:
            return
        packed_head = PackedLinear([head], bias, self.batch_hint)
        with self._lock:
            if generation == self._generation:
                self.packed = Packed(self.packed.layers, packed_head)

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._workers is None:
            self._workers = concurrent.futures.ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="noria-pack")
        return self._workers

    def wait_packed(self) -> None:
        """Block until the packing in progress (if any) is done."""
        if self._packer is not None:
            self._packer.submit(lambda: None).result()

    def _install(self, weights: tuple[list[Linears], torch.Tensor], generation: int) -> None:
        if generation != self._generation:  # the parameters changed again: a newer pack follows
            return
        packed = self._pack(weights)
        with self._lock:
            if generation == self._generation:
                self.packed = packed

    def _weights(self) -> tuple[list[Linears], torch.Tensor]:
        return [_layer_linears(layer) for layer in self.model.model.layers], self.model.lm_head.weight.detach()

    def _pack(self, weights: tuple[list[Linears], torch.Tensor]) -> Packed:
        """The layers packed by torch.get_num_threads() threads at once (oneDNN's reorder gains
        little from its own threads: SmolLM2-135M on two Zen 4 cores, 0.07-0.08 s against 0.09-0.14)."""
        layers, head = weights
        bias = self.model.lm_head.bias
        workers = self._pool()
        packed_head = workers.submit(openmp.released(self._head), [head], [None if bias is None else bias.detach()], self.batch_hint)
        packed_layers = list(workers.map(openmp.released(lambda linears: _PackedLayer(linears, self.batch_hint, self.quantized)), layers))
        return Packed(packed_layers, packed_head.result())

    @torch.no_grad()
    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx, packed: Packed | None = None, embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``DecoderModel.forward`` with packed matmuls: ids [1, T] -> normed hidden [1, T, H].
        ``packed``: the packed weights to use (default :attr:`packed`, which must be there);
        ``embeds``: the input embeddings [1, T, H] when not the ids' (images spliced in, ``noria.engine.vision``)."""
        layers = (packed or self._ready()).layers
        inner = self.model.model
        h = inner.embed_tokens(input_ids) if embeds is None else embeds
        cos, sin = rope_tables(rope_inv_freq(inner.args, input_ids.device), positions, h.dtype)
        if input_ids.shape[1] > self.max_rows and self.quantized is None:
            for layer in inner.layers:
                h = layer(h, cos, sin, ctx)
            return inner.norm(h)
        ops = self._fused_ops(inner)
        if ops is not None:
            return self._fused_forward(ops, inner, layers, h, cos, sin, ctx)
        for layer, one in zip(inner.layers, layers):
            h = self._layer(layer, one, h, cos, sin, ctx)
        return inner.norm(h)

    def _ready(self) -> Packed:
        packed = self.packed
        if packed is None:
            raise RuntimeError("the packed weights are being made (after a weight update): run the model's modules")
        return packed

    @staticmethod
    def _fused_ops(inner):
        """The C++ module when the fused elementwise kernels apply (llama-style layers without q/k
        norms, bf16, the extension built and not switched off), else None."""
        if inner.layers[0].self_attn.q_norm is not None or not kernels.fused_kernels_enabled():
            return None
        return kernels.cpu_kernel()

    def _fused_forward(self, ops, inner, layers, h, cos, sin, ctx) -> torch.Tensor:
        """The layers with the residual add folded into the next norm (``ops.add_rmsnorm``), RoPE
        in one call per layer (``ops.rope``) and SwiGLU's product fused (``ops.silu_mul``)."""
        residual = h  # the embedding output [1, T, H]: a fresh tensor, updated in place
        cos, sin = cos[0], sin[0]  # [T, D]
        pending = None
        for layer, packed in zip(inner.layers, layers):
            norm = layer.input_layernorm
            if pending is None:
                x = ops.add_rmsnorm(residual, None, norm.weight, norm.eps)
            else:
                x = ops.add_rmsnorm(pending, residual, norm.weight, norm.eps)
            attn = layer.self_attn
            heads = packed.qkv(x).unflatten(-1, (-1, attn.head_dim))  # [1, T, Hq + 2 Hkv, D]
            q_size, kv_size, _ = packed.qkv.sizes
            q_heads, kv_heads = q_size // attn.head_dim, kv_size // attn.head_dim
            qk = ops.rope(heads[0], cos, sin, q_heads + kv_heads)[None]
            out = ctx.attend(attn.layer_idx, qk[:, :, :q_heads], qk[:, :, q_heads:], heads[:, :, q_heads + kv_heads :])
            o = packed.o(out.reshape(*x.shape[:2], -1))
            norm = layer.post_attention_layernorm
            x = ops.add_rmsnorm(o, residual, norm.weight, norm.eps)
            pending = packed.down(ops.silu_mul(packed.gate_up(x)))
        return ops.add_rmsnorm(pending, residual, inner.norm.weight, inner.norm.eps)

    def lm_head(self, hidden: torch.Tensor, packed: Packed | None = None) -> torch.Tensor:
        """Logits of hidden rows [R, H] (R <= the step's tokens, so always packed-sized)."""
        if hidden.shape[0] > self.max_rows:
            return self.model.lm_head(hidden)
        return (packed or self._ready()).head(hidden)

    @staticmethod
    def _layer(layer: DecoderLayer, packed: _PackedLayer, x, cos, sin, ctx) -> torch.Tensor:
        x = x + FastDecoder._attention(layer.self_attn, packed, layer.input_layernorm(x), cos, sin, ctx)
        gate, up = packed.gate_up(layer.post_attention_layernorm(x)).split(packed.gate_up.sizes, dim=-1)
        return x + packed.down(F.silu(gate) * up)

    @staticmethod
    def _attention(attn, packed: _PackedLayer, x, cos, sin, ctx) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q_size, kv_size, _ = packed.qkv.sizes
        heads = packed.qkv(x).unflatten(-1, (-1, attn.head_dim))  # [B, T, Hq + 2 Hkv, D]
        q_heads, kv_heads = q_size // attn.head_dim, kv_size // attn.head_dim
        v = heads[:, :, q_heads + kv_heads :]
        if attn.q_norm is None:
            # RoPE is elementwise per head: rotating q and k heads in one call gives the same bits
            # as two calls, with half the small ops.
            q, k = apply_rope(heads[:, :, : q_heads + kv_heads], cos, sin).split([q_heads, kv_heads], dim=2)
        else:
            q, k = heads[:, :, :q_heads], heads[:, :, q_heads : q_heads + kv_heads]
            q, k = apply_rope(attn.q_norm(q), cos, sin), apply_rope(attn.k_norm(k), cos, sin)
        out = ctx.attend(attn.layer_idx, q, k, v)
        return packed.o(out.reshape(batch, seq_len, -1))
