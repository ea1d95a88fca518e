"""The integer weight recipes, the one definition of each (``engine.quantization`` and ``train.qat``):
quantizers, their inverses, and the fake quantization a trainer computes with.

What this module owns: ``quantize_int8`` / ``dequantize_int8`` (symmetric, one scale per output
channel), ``quantize_int4`` / ``dequantize_int4`` (a scale and an offset per group of input
channels), the C++ kernels' layouts (``pack_int8``, ``pack_int4_blocks``), and ``FakeQuant`` / ``set_fake_quant``
(a decoder-block linear computing with its weight quantized and dequantized, straight-through
gradient). It sits below the engine and the trainer, which may not import each other: the engine's
integer layers (``noria.engine.quant``) and the trainer's QAT (``noria.train.fsdp``) both call it,
so the policy trained is the policy served. The recipes themselves are described in
``noria.engine.quant``'s docstring.
"""

from __future__ import annotations

import torch

MODES = ("int8", "int4")
"""The integer values of ``engine.quantization`` (their CPU kernels' layouts are here)."""
QAT_MODES = (*MODES, "fp8")
"""The values of ``train.qat``: the integer modes, exact in deterministic mode, and fp8 (weights and
activations, as ``noria.engine.fp8`` serves them; close, not exact: the engine's FP8 matmul
accumulates in its own order)."""
INT4_GROUP = 32
"""Input channels per int4 scale/offset group."""
MIN_SCALE = 1e-8
"""Floor of every scale (an all-zero row or group would otherwise divide by zero)."""


# ---------------------------------------------------------------------------------------- int8


CHUNK_ROWS = 256
"""Rows quantized at a time: the fp32 temporaries of a chunk stay in cache (and are not fresh pages)."""


def quantize_int8(
    weight: torch.Tensor, dtype: torch.dtype, out: tuple[torch.Tensor, torch.Tensor] | None = None, packed: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 [N, K], scales [N] in ``dtype``) with ``weight ~= q * scale[:, None]``;
    written into ``out`` (codes, scales) when given. ``packed``: the codes in the layout of the C++
    kernel (:func:`pack_int8`), written chunk by chunk."""
    weight = weight.detach()
    n = weight.shape[0]
    if out is None:
        shape = pack_int8_shape(weight.shape) if packed else weight.shape
        out = (torch.empty(shape, dtype=torch.int8), torch.empty(n, dtype=dtype))
    q, scale = out
    for start in range(0, n, CHUNK_ROWS):  # a multiple of PACK_BLOCK: packed chunks are whole blocks
        rows = slice(start, start + CHUNK_ROWS)
        w = weight[rows].to(torch.float32, copy=True)  # divided in place below: never the caller's tensor
        s = (w.abs().amax(dim=1) / 127).clamp_(min=MIN_SCALE).to(dtype)
        scale[rows] = s
        codes = w.div_(s.float()[:, None]).round_().clamp_(-127, 127)
        if packed:
            q[start // PACK_BLOCK : (start + codes.shape[0]) // PACK_BLOCK] = pack_int8(codes)
        else:
            q[rows] = codes
    return q, scale


PACK_BLOCK = 16
"""Output channels per block of the C++ kernel's int8 layout."""


def pack_int8_shape(shape) -> tuple[int, int, int]:
    n, k = shape
    return n // PACK_BLOCK, k // 2, 2 * PACK_BLOCK


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] -> the C++ kernel's layout [N / 16, K / 2, 32]: blocks of 16 output channels, each
    pair of input channels (k, k + 1) as 16 x (q[n, k], q[n, k + 1]) (``kernels/int8_linear.cpp``)."""
    n, k = q.shape
    return q.reshape(n // PACK_BLOCK, PACK_BLOCK, k // 2, 2).permute(0, 2, 1, 3).reshape(pack_int8_shape(q.shape))


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """The codes [N, K] of :func:`pack_int8`'s layout."""
    blocks, pairs, _ = packed.shape
    return packed.reshape(blocks, pairs, PACK_BLOCK, 2).permute(0, 2, 1, 3).reshape(blocks * PACK_BLOCK, pairs * 2)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 weight the int8 matmul computes with."""
    return q.float() * scale.float()[:, None]


# ---------------------------------------------------------------------------------------- int4


def quantize_int4(weight: torch.Tensor, dtype: torch.dtype, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> (codes int32 [N, K] in 0..15, scales [N, K / group], zeros [N, K / group] in ``dtype``)
    with ``weight ~= (q - 8) * scale + zero`` group by group."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group, group)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=MIN_SCALE).to(dtype)
    zero = (lo + 8 * scale.float()).to(dtype)
    lo_rounded = zero.float() - 8 * scale.float()  # the value code 0 stands for, after rounding scale and zero
    q = torch.round((w - lo_rounded[..., None]) / scale.float()[..., None]).clamp_(0, 15).to(torch.int32)
    return q.reshape(n, k), scale, zero


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The fp32 weight the int4 matmul computes with."""
    n, k = q.shape
    groups = scale.shape[1]
    w = (q.float().reshape(n, groups, -1) - 8) * scale.float()[..., None] + zero.float()[..., None]
    return w.reshape(n, k)


def pack_int4_blocks(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_int4`'s output in the C++ kernel's layout (``kernels/int4_linear.cpp``): codes
    uint8 [N / 16, K / 2, 16], blocks of 16 output channels, a pair of input channels (k, k + 1) as
    16 bytes ``q[c, k] | q[c, k + 1] << 4``; scales and zeros fp32 [N / 16, K / group, 16]."""
    n, k = q.shape
    pairs = q.to(torch.uint8).reshape(n // PACK_BLOCK, PACK_BLOCK, k // 2, 2).permute(0, 2, 1, 3)
    codes = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
    blocks = [t.float().reshape(n // PACK_BLOCK, PACK_BLOCK, -1).transpose(1, 2).contiguous() for t in (scale, zero)]
    return codes, blocks[0], blocks[1]


def unpack_int4_blocks(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`pack_int4_blocks` undone: (codes int32 [N, K], scales [N, K / group], zeros), fp32."""
    blocks, pairs, _ = codes.shape
    both = torch.stack([codes & 15, codes >> 4], dim=-1)  # [N / 16, K / 2, 16, 2]
    q = both.permute(0, 2, 1, 3).reshape(blocks * PACK_BLOCK, pairs * 2).to(torch.int32)
    scale, zero = (t.transpose(1, 2).reshape(blocks * PACK_BLOCK, -1) for t in (scale, zero))
    return q, scale, zero


# ----------------------------------------------------------------------------------------- fp8


FP8_MAX = 448.0
"""Largest finite e4m3 value."""
FP8_DTYPE = torch.float8_e4m3fn
FP8_MIN_SCALE = 1e-12
"""Floor of every fp8 scale (an all-zero row or weight channel would otherwise divide by zero)."""


def quantize_fp8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], fp32 scales [1, N]) with ``weight ~= q * scale.T``: one scale per output
    channel, ``amax(|row|) / 448`` (``engine.quantization: fp8``; recipe in ``noria.engine.fp8``)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    return (w / scale).to(FP8_DTYPE), scale.t().contiguous()


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] activations -> (e4m3 [M, K], fp32 scales [M, 1]), one dynamic scale per row (torch ops;
    the engine's Triton kernel on CUDA computes the same values)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    return (xf / scale).to(FP8_DTYPE), scale


# ------------------------------------------------------------------------------- fake quantization


def fake_quantize(weight: torch.Tensor, mode: str, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 weight the ``mode`` matmul computes with for ``weight`` held in ``dtype`` (the engine's
    model dtype): quantized by this module's recipe, then dequantized. No gradient."""
    w = weight.detach().to(dtype)
    if mode == "int8":
        return dequantize_int8(*quantize_int8(w, dtype))
    if mode == "int4":
        return dequantize_int4(*quantize_int4(w, dtype))
    if mode == "fp8":
        q, scale = quantize_fp8_weight(w)
        return q.float() * scale.t()
    raise ValueError(f"fake quantization: unknown mode {mode!r}; supported: {', '.join(QAT_MODES)}")


def fake_quantize_fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """Activations [..., K] as the fp8 engine's matmul reads them (each row quantized to e4m3 with its
    own scale, then dequantized), in ``x``'s dtype, with a straight-through gradient."""
    q, scale = quantize_fp8_rows(x.detach().reshape(-1, x.shape[-1]))
    fq = (q.float() * scale).reshape(x.shape).to(x.dtype)
    return fq + (x - x.detach()) if x.requires_grad else fq


class FakeQuant:
    """A linear layer's weight as the integer engine serves it (``Linear.fake_quant``), with a
    straight-through gradient (the trainer's QAT: ``train.qat``): the forward computes with
    :func:`fake_quantize` of the current weight, the backward passes the gradient to the weight as
    is. For a weight without gradient (an engine's) the dequantized weight is kept until the weight
    changes (its version): a deterministic engine re-quantizes only after a weight update."""

    def __init__(self, mode: str, dtype: torch.dtype) -> None:
        if mode not in QAT_MODES:
            raise ValueError(f"fake quantization: unknown mode {mode!r}; supported: {', '.join(QAT_MODES)}")
        self.mode, self.dtype = mode, dtype
        self._key: tuple | None = None
        self._value: torch.Tensor | None = None

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        if weight.requires_grad:  # a trainer's parameter (its storage may be reused between forwards): never cached
            # the forward's value is the dequantized weight exactly (plus an exact zero), the gradient the weight's
            return fake_quantize(weight, self.mode, self.dtype).to(weight.dtype) + (weight - weight.detach())
        key = (weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape))
        if key != self._key:
            self._key, self._value = key, fake_quantize(weight, self.mode, self.dtype).to(weight.dtype)
        return self._value

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's input as the engine's matmul reads it: fp8 quantizes it per row; the integer
        modes are weight-only (``x`` as it is)."""
        return fake_quantize_fp8_rows(x) if self.mode == "fp8" else x


def set_fake_quant(model: torch.nn.Module, mode: str | None, dtype: torch.dtype) -> int:
    """Give every linear layer of ``model``'s decoder blocks (the ones the integer engine quantizes)
    a :class:`FakeQuant` of ``mode`` (None removes them); returns how many layers changed."""
    count = 0
    for layer in model.model.layers:
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear) and hasattr(type(module), "fake_quant"):
                module.fake_quant = FakeQuant(mode, dtype) if mode else None
                count += 1
    return count
