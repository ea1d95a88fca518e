"""Paged decode attention on CUDA, in Triton.

Same contract as ``noria.engine.attention_ref.paged_decode_attention``: q [S, Hq, D] attends over
the first ``context_lens[s]`` tokens of sequence s, whose K/V live in pools [slots, Hkv, D] at
``block_tables[s, p // block_size] * block_size + p % block_size``.

Grid: (S, Hkv, splits). A program loads the G = Hq / Hkv query heads of its KV head (padded to
16 rows so the two products run on tensor cores), then walks its share of the context
``BLOCK_N`` tokens at a time: gather the pages' K rows, scores in fp32, online softmax (running
max and sum), gather V rows, accumulate. Every K/V byte is read once per step, which is the whole
cost of decode attention. When S * Hkv programs are too few to fill the GPU, the context is split
over ``splits`` programs whose partial (max, sum, output) are merged by a second small kernel.

Blocking: none; the loop bound is read on the device, so the launch is CUDA-graph safe (the split
count depends only on S, Hkv and the block-table width, all static in a captured graph). The
tokens per split are a runtime argument: a wider table (a longer context) compiles nothing new
unless the split count changes.
"""

from __future__ import annotations

import torch

_KERNELS = None
BLOCK_N = 64
"""Tokens per inner iteration (several pages when block_size < 64)."""
NUM_WARPS = 4
NUM_STAGES = 2
"""Launch settings of the main kernel (``noria bench gpu-profile`` sweeps them)."""


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _build()
    return _KERNELS


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def decode_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, m_ptr, l_ptr,
        scale_log2, split_tokens,
        stride_qs, stride_qh, stride_ks, stride_kh, stride_bt, stride_os, stride_oh,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
        PAGE: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    ):
        s = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(lens_ptr + s)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        gmask = g < GROUP
        heads = h * GROUP + g
        q = tl.load(q_ptr + s * stride_qs + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        lo = split * split_tokens
        hi = tl.minimum(length, lo + split_tokens)
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            valid = pos < hi
            page = tl.load(bt_ptr + s * stride_bt + pos // PAGE, mask=valid, other=0)
            slot = page.to(tl.int64) * PAGE + pos % PAGE
            kv_off = slot[:, None] * stride_ks + h * stride_kh + d[None, :]
            k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # log2 domain
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        if SPLITS == 1:
            out = acc / l_i[:, None]
            tl.store(out_ptr + s * stride_os + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
        else:
            # partials [S, Hq, SPLITS, D] fp32 and (m, l) [S, Hq, SPLITS]
            row = (s * stride_os // D + heads) * SPLITS + split  # stride_os == Hq * D for partials
            tl.store(out_ptr + row[:, None] * D + d[None, :], acc, mask=gmask[:, None])
            tl.store(m_ptr + row, m_i, mask=gmask)
            tl.store(l_ptr + row, l_i, mask=gmask)

    @triton.jit
    def merge_kernel(part_ptr, m_ptr, l_ptr, out_ptr, SPLITS: tl.constexpr, D: tl.constexpr):
        row = tl.program_id(0)  # s * Hq + head
        sp = tl.arange(0, SPLITS)
        d = tl.arange(0, D)
        m = tl.load(m_ptr + row * SPLITS + sp)
        l = tl.load(l_ptr + row * SPLITS + sp)
        top = tl.max(m, 0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - top))
        parts = tl.load(part_ptr + (row * SPLITS + sp)[:, None] * D + d[None, :])
        out = tl.sum(parts * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty))

    return decode_kernel, merge_kernel


def choose_splits(num_seqs: int, num_kv_heads: int, max_context: int, target_programs: int = 1024) -> int:
    """Context splits per (sequence, KV head): enough programs to fill the GPU, each at least
    ``4 * BLOCK_N`` tokens; a power of two (the merge kernel's width)."""
    splits = 1
    while num_seqs * num_kv_heads * splits < target_programs and max_context // (splits * 2) >= 4 * BLOCK_N:
        splits *= 2
    return splits


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """q [S, Hq, D] over each sequence's first ``context_lens[s]`` cached tokens -> [S, Hq, D]."""
    import triton

    decode_kernel, merge_kernel = _kernels()
    num_seqs, hq, d = q.shape
    hkv = k_pool.shape[1]
    group = hq // hkv
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    out = torch.empty_like(q)
    width = block_tables.shape[1] * block_size  # longest context the tables can describe
    splits = choose_splits(num_seqs, hkv, width)
    split_tokens = triton.cdiv(triton.cdiv(width, splits), BLOCK_N) * BLOCK_N
    block_g = max(16, triton.next_power_of_2(group))
    scale_log2 = scale * 1.4426950408889634
    if splits == 1:
        target, m, l = out, out, out
    else:
        target = torch.empty(num_seqs, hq, splits, d, dtype=torch.float32, device=q.device)
        m = torch.empty(num_seqs, hq, splits, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
    decode_kernel[(num_seqs, hkv, splits)](
        q, k_pool, v_pool, block_tables, context_lens, target, m, l,
        scale_log2, split_tokens,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), block_tables.stride(0), hq * d, d,
        GROUP=group, BLOCK_G=block_g, D=d, BLOCK_N=BLOCK_N, PAGE=block_size,
        SPLITS=splits, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 models: no tf32 rounding
    )
    if splits > 1:
        merge_kernel[(num_seqs * hq,)](target, m, l, out, SPLITS=splits, D=d, num_warps=4)
    return out
