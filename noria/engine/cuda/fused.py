"""Fused decode forward and device sampling on CUDA, in Triton.

A decode step of the native model launches about 45 kernels per layer in eager PyTorch (RMSNorm
alone is six: cast, square, mean, rsqrt, scale, weight; RoPE about ten). Inside a captured graph
each still costs a few microseconds of GPU time, so at rollout batch sizes the small kernels take
as long as the bytes they move. :class:`FusedDecoder` runs the same layer with four Triton kernels
around the projections (which stay cuBLAS GEMMs on the model's own parameters, no weight copies):

- ``add_rmsnorm``: ``residual += x`` (rounded to the model dtype) and ``RMSNorm(residual)``, one
  program per row (the residual add of every block is folded into the next norm);
- ``qk_norm_rope_store``: per (token, head): Qwen3's per-head q/k RMSNorm, RoPE (cos/sin read from
  a table built by ``rope_tables``, the model's own function) on q and k, and the K/V writes into
  the paged pools at the tokens' slots;
- ``silu_mul``: ``silu(gate) * up``;
- ``sample_rows``: one token per row from ``[S, V]`` logits, greedy (argmax) or temperature
  sampling by inverse CDF of ``softmax(logits / T)`` at a given uniform ``u``, and the chosen
  token's logprob ``log_softmax(logits / T)[token]`` (the recipe of ``noria.engine.sampling``),
  in two streaming passes over the row with no ``[S, V]`` temporaries.

Numerics: every kernel computes in fp32 and rounds to the model dtype at the points where the
eager modules round (the residual sum, the normed activations before the weight, each RoPE
product and their sum, silu before the product). Measured on an H200 (bf16): add_rmsnorm and
silu_mul were bit-exact against the eager modules; RoPE differed in about 9% of q/k elements by
one rounding step (the products' roundings are not all reproduced by the compiled kernel; not
pinned down). The GPU test bounds both; deterministic mode never runs these kernels.

Used for decode steps inside :class:`~noria.engine.cuda.graphs.DecodeGraphs` (outside
deterministic mode); prefill stays on the eager modules. ``FusedDecoder.supported(model)`` says
whether a model fits (head_dim a power of two, ``hidden_size`` and ``head_dim`` within one
program's tile).
"""

from __future__ import annotations

import functools

import torch

from noria.engine import fp8
from noria.models.decoder import DecoderLM, rope_inv_freq, rope_tables

SAMPLE_BLOCK = 4096
"""Vocabulary entries per iteration of the sampling kernel."""


@functools.cache
def _kernels():
    """The Triton kernels, built on first use (Triton is imported only then)."""
    import triton

    return {
        "add_rmsnorm": _add_rmsnorm_kernel(), "qk": _qk_norm_rope_store_kernel(), "silu_mul": _silu_mul_kernel(),
        "sample": _sample_kernel(), "next_pow2": triton.next_power_of_2,
    }


def _add_rmsnorm_kernel():
    """``residual += x`` (rounded to the model dtype) and RMSNorm of the sum, one program per row."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
            x = (r.to(tl.float32) + x.to(tl.float32)).to(r.dtype)
            tl.store(res_ptr + row * n_cols + cols, x, mask=mask)
        h = x.to(tl.float32)
        var = tl.sum(h * h, axis=0) / n_cols
        normed = (h * (1.0 / tl.sqrt(var + eps))).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)

    return add_rmsnorm_kernel


def _qk_norm_rope_store_kernel():
    """Per (token, head): q/k RMSNorm (Qwen3), RoPE on q and k, and the K/V writes into the paged pools."""
    import triton
    import triton.language as tl

    @triton.jit
    def qk_norm_rope_store_kernel(
        q_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_pool, v_pool, eps,
        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        half = tl.arange(0, D // 2)
        is_q = h < HQ
        if is_q:
            base = q_ptr + t * (HQ * D) + h * D
        else:
            base = k_ptr + t * (HKV * D) + (h - HQ) * D
        xa = tl.load(base + half)
        xb = tl.load(base + D // 2 + half)
        dtype = xa.dtype
        if QK_NORM:
            if is_q:
                wa = tl.load(qn_ptr + half).to(tl.float32)
                wb = tl.load(qn_ptr + D // 2 + half).to(tl.float32)
            else:
                wa = tl.load(kn_ptr + half).to(tl.float32)
                wb = tl.load(kn_ptr + D // 2 + half).to(tl.float32)
            fa, fb = xa.to(tl.float32), xb.to(tl.float32)
            inv = 1.0 / tl.sqrt((tl.sum(fa * fa, axis=0) + tl.sum(fb * fb, axis=0)) / D + eps)
            xa = (wa * (fa * inv).to(dtype).to(tl.float32)).to(dtype)
            xb = (wb * (fb * inv).to(dtype).to(tl.float32)).to(dtype)
        pos = tl.load(pos_ptr + t)
        ca = tl.load(cos_ptr + pos * D + half).to(tl.float32)
        cb = tl.load(cos_ptr + pos * D + D // 2 + half).to(tl.float32)
        sa = tl.load(sin_ptr + pos * D + half).to(tl.float32)
        sb = tl.load(sin_ptr + pos * D + D // 2 + half).to(tl.float32)
        fa, fb = xa.to(tl.float32), xb.to(tl.float32)
        # x * cos + cat(-x2, x1) * sin, each product and the sum rounded like the eager ops
        oa = ((fa * ca).to(dtype).to(tl.float32) + (-(fb * sa).to(dtype).to(tl.float32))).to(dtype)
        ob = ((fb * cb).to(dtype).to(tl.float32) + (fa * sb).to(dtype).to(tl.float32)).to(dtype)
        if is_q:
            tl.store(base + half, oa)
            tl.store(base + D // 2 + half, ob)
        else:
            kh = h - HQ
            slot = tl.load(slot_ptr + t).to(tl.int64)
            dst = slot * (HKV * D) + kh * D
            tl.store(k_pool + dst + half, oa)
            tl.store(k_pool + dst + D // 2 + half, ob)
            src = v_ptr + t * (HKV * D) + kh * D
            full = tl.arange(0, D)
            tl.store(v_pool + dst + full, tl.load(src + full))

    return qk_norm_rope_store_kernel


def _silu_mul_kernel():
    """``silu(gate) * up``, rounded where the eager modules round."""
    import triton
    import triton.language as tl

    @triton.jit
    def silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
        tl.store(out_ptr + offs, (s * u).to(g.dtype), mask=mask)

    return silu_mul_kernel


def _sample_kernel():
    """Sampling from each row's logits in two passes over the vocabulary (max and mass, then the draw)."""
    import triton
    import triton.language as tl

    @triton.jit
    def sample_kernel(logits_ptr, stride, temps_ptr, u_ptr, out_ptr, n_rows, V, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride
        t = tl.load(temps_ptr + row)
        div = tl.where(t > 0.0, t, 1.0)
        offs0 = tl.arange(0, BLOCK)
        # pass 1: running max (and the first id reaching it) and the sum of exp against it
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        best = tl.zeros((), tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + offs0
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / div
            bm = tl.max(x, axis=0)
            bi = tl.min(tl.where(x == bm, offs, V), axis=0)
            best = tl.where(bm > m, bi, best)
            new_m = tl.maximum(m, bm)
            s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
            m = new_m
        chosen = best
        if t > 0.0:
            # pass 2: the first id whose running mass exceeds u * total (vocabulary order)
            target = tl.load(u_ptr + row) * s
            acc = tl.zeros((), tl.float32)
            found = tl.full((), -1, tl.int32)
            last = tl.zeros((), tl.int32)
            for start in range(0, V, BLOCK):
                offs = start + offs0
                x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / div
                w = tl.exp(x - m)
                c = tl.cumsum(w, axis=0) + acc
                hit = tl.min(tl.where(c > target, offs, V), axis=0)
                found = tl.where((found < 0) & (hit < V), hit, found)
                last = tl.maximum(last, tl.max(tl.where(w > 0.0, offs, 0), axis=0))
                acc += tl.sum(w, axis=0)
            # rounding can leave u * total at the very end: the last id with mass
            chosen = tl.where(found < 0, last, found)
        x_c = tl.load(base + chosen).to(tl.float32) / div
        tl.store(out_ptr + row, chosen.to(tl.float64))
        tl.store(out_ptr + n_rows + row, (x_c - (m + tl.log(s))).to(tl.float64))

    return sample_kernel


def add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``RMSNorm(residual + x)`` for x [N, H] (``residual`` updated in place to the rounded sum), or
    ``RMSNorm(x)`` when ``residual`` is None; the result in x's dtype."""
    k = _kernels()
    n, h = x.shape
    out = torch.empty_like(x)
    res = residual if residual is not None else x
    k["add_rmsnorm"][(n,)](x, res, weight, out, h, eps, HAS_RES=residual is not None, BLOCK=k["next_pow2"](h))
    return out


def qk_norm_rope_store(q, k, v, q_norm, k_norm, cos, sin, positions, slots, k_pool, v_pool, eps: float) -> None:
    """In place on q [N, Hq*D]: (q-norm and) RoPE; k [N, Hkv*D] normed and rotated and v are written
    into the pools [slots, Hkv, D] at ``slots`` [N]. ``q_norm``/``k_norm`` None: no per-head norm."""
    kern = _kernels()
    n = q.shape[0]
    hkv, d = k_pool.shape[1], k_pool.shape[2]
    hq = q.shape[1] // d
    qk = q_norm is not None
    kern["qk"][(n, hq + hkv)](
        q, k, v, q_norm if qk else q, k_norm if qk else q, cos, sin, positions, slots, k_pool, v_pool, eps,
        HQ=hq, HKV=hkv, D=d, QK_NORM=qk,
    )


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, elementwise, contiguous inputs of one shape."""
    out = torch.empty_like(gate)
    n = gate.numel()
    block = 1024
    _kernels()["silu_mul"][(triton_cdiv(n, block),)](gate, up, out, n, BLOCK=block)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sample_rows(logits: torch.Tensor, temps: torch.Tensor, uniforms: torch.Tensor, out: torch.Tensor | None = None):
    """One token per row of logits [S, V]: argmax where ``temps`` <= 0, else the inverse-CDF draw of
    ``softmax(logits / T)`` at ``uniforms``; returns fp64 [2, S]: the ids and their logprobs
    ``log_softmax(logits / T)`` (``log_softmax(logits)`` for greedy rows). fp64 holds both exactly,
    so one copy to the host reads a step's results."""
    s, v = logits.shape
    if out is None:
        out = torch.empty(2, s, dtype=torch.float64, device=logits.device)
    if s:
        _kernels()["sample"][(s,)](logits, logits.stride(0), temps, uniforms, out, s, v, BLOCK=SAMPLE_BLOCK)
    return out


class FusedDecoder:
    """The decode forward of a :class:`DecoderLM` with the fused kernels above (see the module
    docstring). Reads the model's parameters at call time; the RoPE table is built once."""

    def __init__(self, model: DecoderLM, max_positions: int) -> None:
        self.model = model
        args = model.args
        p = next(model.parameters())
        positions = torch.arange(max_positions, device=p.device)
        cos, sin = rope_tables(rope_inv_freq(args, p.device), positions, p.dtype)
        self.cos, self.sin = cos.contiguous(), sin.contiguous()
        self.eps = args.rms_norm_eps

    @staticmethod
    def supported(model: DecoderLM) -> bool:
        a = model.args
        d = a.head_dim
        return d >= 16 and d & (d - 1) == 0 and d <= 256 and a.hidden_size <= 16384

    def hidden_states(
        self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv, attend, routing=None
    ) -> torch.Tensor:
        """Final normed hidden states [N, H] of N decode tokens (ids, positions, slots: [N]);
        ``attend(layer, q [N, Hq, D], k_pool, v_pool)`` is the paged decode attention. MoE layers run
        their own block (grouped expert GEMMs), recording routes in ``routing``."""
        m = self.model.model
        eps = self.eps
        x = m.embed_tokens(ids)
        residual = None
        pending = x
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            if residual is None:
                residual = x
                h = add_rmsnorm(x, layer.input_layernorm.weight, eps)
            else:
                h = add_rmsnorm(pending, layer.input_layernorm.weight, eps, residual)
            q, k, v = fp8.shared_input(h, (a.q_proj, a.k_proj, a.v_proj))
            k_pool, v_pool = kv.k_pools[i], kv.v_pools[i]
            qk_norm_rope_store(q, k, v, a.q_norm.weight if a.q_norm is not None else None,
                               a.k_norm.weight if a.k_norm is not None else None, self.cos, self.sin,
                               positions, slots, k_pool, v_pool, eps)
            out = attend(i, q.view(q.shape[0], -1, a.head_dim), k_pool, v_pool)
            attn = a.o_proj(out.reshape(q.shape[0], -1))
            h = add_rmsnorm(attn, layer.post_attention_layernorm.weight, eps, residual)
            mlp = layer.mlp
            if layer.sparse:
                pending = mlp(h.unsqueeze(0), routing)[0]
            else:
                g, u = fp8.shared_input(h, (mlp.gate_proj, mlp.up_proj))
                pending = mlp.down_proj(silu_mul(g, u))
        return add_rmsnorm(pending, m.norm.weight, eps, residual)
