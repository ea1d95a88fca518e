"""FP8 rollout weights (``engine.quantization: fp8``): e4m3 linear layers for a bf16-trained policy.

What is quantized: every ``Linear`` of the decoder blocks (q/k/v/o, gate/up/down). The embedding,
the norms, attention, the K/V cache and the LM head stay in the model dtype (the head decides the
logprobs the trainer compares against; it is one matmul of many).

Recipe (the one DeepSeek-V3 and SGLang's ``fp8`` use per channel):

- weights: e4m3 with one fp32 scale per output channel, ``scale = amax(|row|) / 448``, made from
  the bf16 parameters at engine start and again after every weight update
  (:func:`quantize_model`, called by ``ModelRunner.refresh_weights``);
- activations: quantized per row on the fly (dynamic, ``amax / 448``): a Triton kernel on CUDA
  (one program per row: amax, scale, cast), torch ops elsewhere; q/k/v share one quantization of
  their input, as do gate/up;
- the product: ``torch._scaled_mm`` with both scale vectors (row-wise scaling; FP8 tensor cores on
  Hopper and later), out in the model dtype, bias added after; on CPU the same product of the
  e4m3 values in fp32 (oneDNN's ``_scaled_mm`` takes per-tensor scales only in some torch versions),
  which serves the tests and CPU runs, not speed.

The bf16 parameters stay: weight updates land in them and are re-quantized (so the FP8 copy costs
half the linear weights' bytes on top, it does not save memory). The engine's tokens therefore
come from a slightly different policy than the trainer's: the rollout-vs-trainer logprob gap is
reported by the RL loop (``rollout_logprob_abs_diff``) and corrected with
``train.loss.off_policy: tis`` (``noria bench gpu-fp8`` measures both against bf16 rollout).

The quantizers are ``noria.models.quantize``'s (the recipe's one owner, below the engine and the
trainer): ``train.qat: fp8`` trains with the same weight and activation rounding (fake quantization,
straight-through gradients), which narrows the rollout/trainer gap; it does not close it (the FP8
matmul accumulates in its own order).

Contract with the model: ``noria.models.decoder.Linear`` calls ``module.fp8(x, bias)`` instead of
its matmul when the attribute is set; :func:`clear_model` removes every copy.
"""

from __future__ import annotations

import functools

import torch

from noria.models.quantize import FP8_DTYPE as DTYPE
from noria.models.quantize import FP8_MAX
from noria.models.quantize import FP8_MIN_SCALE as MIN_SCALE
from noria.models.quantize import quantize_fp8_rows
from noria.models.quantize import quantize_fp8_weight as quantize_weight


def supported(model: torch.nn.Module) -> str | None:
    """None if the model can be served in FP8 here, else the reason it cannot."""
    if not hasattr(torch, "_scaled_mm"):
        return "this torch has no torch._scaled_mm"
    first = next(model.parameters())
    if first.dtype != torch.bfloat16:
        return f"FP8 serving needs a bfloat16 model (row-wise scaled FP8 matmuls produce bf16), got {first.dtype}"
    if first.device.type == "cuda" and torch.cuda.get_device_capability(first.device) < (8, 9):
        return f"FP8 matmuls need compute capability 8.9 or newer, {torch.cuda.get_device_name(first.device)} has less"
    for name, module in _linears(model):
        n, k = module.weight.shape
        if n % 16 or k % 16:
            return f"{name} has shape [{n}, {k}]; FP8 matmuls need both dimensions multiples of 16"
    return None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] activations -> (e4m3 [M, K], fp32 scales [M, 1]), one scale per row (the recipe's owner:
    ``noria.models.quantize.quantize_fp8_rows``; on CUDA the same values from one Triton program per row)."""
    if x.is_cuda and _triton():
        return _quantize_rows_triton(x.contiguous())
    return quantize_fp8_rows(x)


class Fp8Weight:
    """The FP8 copy of one linear layer's weight; called as the layer's matmul."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.scale = quantize_weight(weight)
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        xq, sx = quantize_rows(x.reshape(-1, shape[-1]))
        return self.matmul(xq, sx, bias, x.dtype).reshape(*shape[:-1], self.out_features)

    def matmul(self, xq: torch.Tensor, sx: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype):
        """The product of already-quantized rows (shared by layers that read the same input)."""
        if xq.is_cuda:
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=sx, scale_b=self.scale, out_dtype=out_dtype)
        else:  # CPU: oneDNN's _scaled_mm takes per-tensor scales only (torch 2.11): the same product in fp32
            y = (torch.mm(xq.float(), self.weight.float().t()) * sx * self.scale).to(out_dtype)
        return y if bias is None else y + bias


def _linears(model: torch.nn.Module):
    from noria.models.decoder import Linear  # the layer class that honours ``fp8``

    for i, layer in enumerate(model.model.layers):
        for name, module in layer.named_modules():
            if isinstance(module, Linear):
                yield f"model.layers.{i}.{name}", module


def quantize_model(model: torch.nn.Module) -> int:
    """Give every decoder-block linear an FP8 copy of its current weight; returns how many.
    Raises ValueError if :func:`supported` says no."""
    reason = supported(model)
    if reason is not None:
        raise ValueError(f"engine.quantization=fp8: {reason}")
    n = 0
    with torch.no_grad():
        for _, module in _linears(model):
            module.fp8 = Fp8Weight(module.weight)
            n += 1
    return n


def clear_model(model: torch.nn.Module) -> None:
    """Drop every FP8 copy (the layers compute in their own dtype again)."""
    for _, module in _linears(model):
        module.__dict__.pop("fp8", None)


def shared_input(x: torch.Tensor, modules) -> list[torch.Tensor]:
    """``[m(x) for m in modules]`` with one activation quantization when the layers are FP8."""
    if getattr(modules[0], "fp8", None) is None:
        return [torch.nn.functional.linear(x, m.weight, m.bias) for m in modules]
    xq, sx = quantize_rows(x.reshape(-1, x.shape[-1]))
    return [m.fp8.matmul(xq, sx, m.bias, x.dtype).reshape(*x.shape[:-1], m.fp8.out_features) for m in modules]


@functools.cache
def _triton() -> bool:
    from noria.engine.cuda import triton_available

    return triton_available()


@functools.cache
def _row_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, n_cols, FMAX: tl.constexpr, FLOOR: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FMAX, FLOOR)
        # div_rn: IEEE round-to-nearest division, as torch's x / scale (a plain / compiles to an approximate
        # division: on an H100, 1,099 of 3.7M values rounded to another e4m3 value than torch's recipe)
        tl.store(q_ptr + row * n_cols + cols, tl.math.div_rn(x, scale).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)

    return quantize_rows_kernel, triton.next_power_of_2


def _quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    kernel, next_pow2 = _row_kernel()
    m, k = x.shape
    q = torch.empty(m, k, dtype=DTYPE, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = next_pow2(k)
        kernel[(m,)](x, q, scale, k, FMAX=FP8_MAX, FLOOR=MIN_SCALE, BLOCK=block, num_warps=max(1, min(16, block // 256)))
    return q, scale
