"""Exact numerics on CUDA: batch-invariant Triton kernels for the ops whose cuBLAS / torch CUDA
kernels change a row's bits with the number of rows in the call.

Exact mode (``DecoderLM.set_exact_numerics``, the deterministic mode of engine and trainer) asks
every op to give a token the same bits whatever else shares the call. On CPU the torch kernels do,
in the shapes ``decoder.row_chunked_linear`` and ``attention.exact_attention`` arrange. On CUDA
they do not: cuBLAS picks its GEMM kernel (tiles, split-K) by shape, and torch's row reductions
pick their thread layout by the number of rows. These kernels fix everything that decides the
order of a row's arithmetic:

- :func:`linear`: ``x @ w.T + b`` with fixed tiles (``LINEAR_BLOCKS``), fp32 accumulation over K
  in one loop in order, no split-K; a row's result does not depend on M or on the other rows;
- :func:`rms_norm`: one program per row, the sum of squares in one fixed-width ``tl.sum``;
- :func:`attention`: ``exact_attention``'s contract (query i of row b sees keys
  0 .. q_pos[b, i]), flash-style: a program takes a fixed ``ATTN_ROWS`` query rows of one KV head
  and walks the keys ``ATTN_BLOCK_N`` at a time from key 0, online softmax in fp32. Key blocks past
  a query's last key change nothing in its row (all its scores are -inf there: rescale by exactly 1,
  add exact zeros), so neither the context length nor the other queries of the program matter.

Engine and trainer both run these on CUDA, so they agree bit for bit there, as on CPU; the bits
are not the CPU recipe's (other summation orders). The backward passes are the usual torch ops
(the gradient of the same function up to rounding). Needs Triton; ``available()`` says whether
this path is taken. Measured on an H200 (tests/engine/test_engine_cuda.py); not promised by Triton.
"""

from __future__ import annotations

import functools

import torch

LINEAR_BLOCKS = (64, 128, 64)
"""BLOCK_M, BLOCK_N, BLOCK_K of :func:`linear` (fixed: the order of a row's sums depends on them)."""
ATTN_ROWS = 64
"""Query rows (queries x heads of one KV group) per program of :func:`attention`."""
ATTN_BLOCK_N = 64
"""Keys per iteration of :func:`attention`."""


@functools.cache
def available() -> bool:
    """Triton imports and a CUDA device is present (also the engine's ``cuda.triton_available``)."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernels():
    """(linear, rms, attn) Triton kernels, built on first use (Triton is imported only then)."""
    return _linear_kernel(), _rms_kernel(), _attn_kernel()


def _linear_kernel():
    """``x @ w.T + b`` in fixed tiles, fp32 accumulation over K in one ordered loop, no split-K."""
    import triton
    import triton.language as tl

    @triton.jit
    def linear_kernel(
        x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0)
            b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K),
                        other=0.0)
            acc += tl.dot(a, b, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    return linear_kernel


def _rms_kernel():
    """RMSNorm, one program per row: the sum of squares in one fixed-width ``tl.sum``."""
    import triton
    import triton.language as tl

    @triton.jit
    def rms_kernel(x_ptr, w_ptr, out_ptr, H, stride_x, stride_o, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        h = x.to(tl.float32)
        h = h * tl.rsqrt(tl.sum(h * h, 0) / H + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # As the module: normalised in fp32, rounded to the input dtype, then times the weight.
        y = w * h.to(x.dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    return rms_kernel


def _attn_kernel():
    """Flash-style ``exact_attention``: ``ROWS`` query rows of one KV head per program, keys from 0 in fixed blocks."""
    import triton
    import triton.language as tl

    @triton.jit
    def attn_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, n, scale_log2,
        sq_b, sq_n, sq_h, sk_b, sk_l, sk_h, sv_b, sv_l, sv_h, so_b, so_n, so_h, sp_b, sp_n,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
        BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(2)
        r = tl.arange(0, ROWS)
        qi = tl.program_id(1) * (ROWS // BLOCK_G) + r // BLOCK_G
        g = r % BLOCK_G
        valid = (qi < n) & (g < GROUP)
        head = h * GROUP + g
        d = tl.arange(0, DP)  # head_dim padded to a power of two >= 16 (tl.dot's smallest side)
        dmask = d[None, :] < D
        q = tl.load(q_ptr + b * sq_b + qi[:, None] * sq_n + head[:, None] * sq_h + d[None, :],
                    mask=valid[:, None] & dmask, other=0.0)
        pos = tl.load(pos_ptr + b * sp_b + qi * sp_n, mask=valid, other=-1)
        hi = tl.max(pos, 0) + 1
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, DP], tl.float32)
        for start in range(0, hi, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            kmask = keys < hi  # keys past every query here may be unwritten cache: never loaded
            k = tl.load(k_ptr + b * sk_b + keys[:, None] * sk_l + h * sk_h + d[None, :], mask=kmask[:, None] & dmask,
                        other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            s = tl.where(keys[None, :] <= pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + b * sv_b + keys[:, None] * sv_l + h * sv_h + d[None, :], mask=kmask[:, None] & dmask,
                        other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * so_b + qi[:, None] * so_n + head[:, None] * so_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & dmask)

    return attn_kernel


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 models: no tf32 rounding


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (forward only), batch-invariant; x [..., K], weight [N, K]."""
    import triton

    kernel = _kernels()[0]
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    weight = weight.contiguous()
    m, k = flat.shape
    n = weight.shape[0]
    out = flat.new_empty(m, n)
    bm, bn, bk = LINEAR_BLOCKS
    kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        flat, weight, bias if bias is not None else weight, out, m, n, k, flat.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        PRECISION=_precision(x.dtype), num_warps=4, num_stages=3,
    )
    return out.view(*x.shape[:-1], n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm`` of the last dimension, batch-invariant; differentiable (torch backward)."""
    return _RMSNorm.apply(x, weight, eps)


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        import triton

        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        dtype = torch.promote_types(x.dtype, weight.dtype)
        out = torch.empty(flat.shape, dtype=dtype, device=x.device)
        h = flat.shape[1]
        _kernels()[1][(flat.shape[0],)](flat, weight.contiguous(), out, h, flat.stride(0), out.stride(0), eps,
                                        BLOCK=triton.next_power_of_2(h), num_warps=4)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = _rms_norm_torch(x, weight, ctx.eps)
        gx, gw = torch.autograd.grad(out, (x, weight), grad)
        return gx, gw, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_pos: torch.Tensor) -> torch.Tensor:
    """``exact_attention``'s contract on CUDA (forward only): q [B, n, Hq, D], k/v [B, L, Hkv, D],
    q_pos long [B, n] (every q_pos < L) -> [B, n, Hq, D] in q's dtype."""
    import triton

    batch, n, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    block_g = triton.next_power_of_2(group)
    if block_g > ATTN_ROWS:
        raise ValueError(f"exact CUDA attention: {group} query heads per KV head (at most {ATTN_ROWS})")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    q_pos = q_pos.expand(batch, n)
    per_program = ATTN_ROWS // block_g
    _kernels()[2][(batch, triton.cdiv(n, per_program), hkv)](
        q, k, v, q_pos, out, n, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        q_pos.stride(0), q_pos.stride(1),
        GROUP=group, BLOCK_G=block_g, ROWS=ATTN_ROWS, D=d, DP=max(16, triton.next_power_of_2(d)),
        BLOCK_N=ATTN_BLOCK_N, PRECISION=_precision(q.dtype),
        num_warps=4, num_stages=2,
    )
    return out
