"""Weight-only integer rollout on CPU (``engine.quantization: int8 | int4``): the quantizers and the
quantized linear layers of the engine's fast decoder.

What is quantized: the four matmuls of every decoder block as the fast decoder groups them
(q/k/v as one, o, gate/up as one, down: ``noria.engine.inference``). The embedding, the norms,
attention, the K/V cache and the LM head stay in the model dtype (the head decides the logprobs the
trainer compares against). Activations are never quantized: each product takes bf16 activations
(an fp32 model's are rounded to bf16 for it, and the result widened back) against integer weights,
dequantized inside the kernel: one recipe for every kernel and model dtype (torch's kernels are
vectorized for bf16 activations only: fp32 and fp16 activations ran 30-90x slower).

Recipes (``noria.models.quantize`` holds the one definition of each, below the engine and the
trainer, which fake-quantizes with them; re-exported here):

- ``int8``: symmetric, one scale per output channel: ``scale = amax(|row|) / 127`` rounded to
  bf16, ``q = clamp(round_half_even(w / scale), -127, 127)``, ``w ~= q * scale``;
- ``int4``: asymmetric, one scale and one offset per group of :data:`INT4_GROUP` input channels
  of a row (the layout of torch's int4 CPU kernel): ``scale = (max - min) / 15``, ``q = clamp(round(
  (w - min) / scale), 0, 15)``, ``w ~= (q - 8) * scale + zero`` with ``zero = min + 8 * scale``;
  scale and zero rounded to bf16.

Kernels. int8: our C++ kernel (``kernels/int8_linear.cpp``: codes in a packed layout of 16-channel
blocks, converted to bf16 in registers and multiplied with AVX512_BF16's ``vdpbf16ps``, or to fp32
with AVX2 FMA; every weight byte read once per call), where it is built and the shape is a multiple
of 16 outputs and 2 inputs; torch's ``aten._weight_int8pack_mm`` otherwise (``NORIA_NO_CPU_KERNEL=1``,
odd shapes). int4: our C++ kernel (``kernels/int4_linear.cpp``: two codes a byte in the same
16-channel blocks; each block dequantized once per call to the recipe's weights, in bf16, then the
int8 kernel's row tiles) for bf16 models where the CPU has AVX512_BF16; torch's
``aten._weight_int4pack_mm_for_cpu`` (weights packed once by ``_convert_weight_to_int4pack_for_cpu``)
elsewhere. int4 on the machine of the int8 table below, measured the same way (one thread, best of 8
sweeps over 30 distinct SmolLM2-135M blocks, microseconds per block), on a quiet machine, one run:

=================  ========  ========  ========  ========
rows               1         8         32        128
=================  ========  ========  ========  ========
AVX-512 ours       512       687       1507      4691
AVX-512 torch      233       728       2768      10751
AVX2 ours (fp32)   537       1604      5445      19967
AVX2 torch         482       1106      4229      16842
=================  ========  ========  ========  ========

So ours serves bf16 models on AVX-512 BF16, where rollout batches (8 rows and up) run 1.1-2.3x
faster; at 1 row torch's is 2.2x faster (its dequantization is cheaper than ours: a long tail of
single rows runs slower). The AVX2 row above predates the fix of the fma path described below; since
then (fp32 model, 2 threads, microseconds per block at 1, 8, 32 and 128 rows) ours ran 330, 548,
1419 and 4895 against torch's 272, 595, 2229 and 9261 acting as AVX2, so ours serves every model
there too; natively an fp32 model ran 328, 514, 1334 and 6043 against 163, 441, 1609 and 6211, so
torch's keeps fp32 models on AVX-512. int8, measured on an AMD EPYC Zen 4 (AVX-512 with AVX512_BF16),
one thread (the 2 cores were shared with a training run that made 2-thread figures swing 2-5x),
best of 8 sweeps over 30 distinct SmolLM2-135M blocks (the four matmuls 576 -> 960, 576 -> 576,
576 -> 3072, 1536 -> 576; 106 M weights, so they stream from memory as in decode), microseconds per
block; "AVX2": the same machine with ``NORIA_CPU_ISA=avx2`` (oneDNN has no bf16 kernels there, the
engine's own path is fp32; our kernel's fma path). Two runs each (our AVX2 kernel: bf16 and fp32
activations in one run); the spread is the noise:

===========  ===========  ===========  ===========  ===========
rows         our int8     torch int8   packed bf16  packed fp32
===========  ===========  ===========  ===========  ===========
AVX-512 1    303-360      556-619      682-717      1507-1544
AVX-512 8    443-590      1296-1435    635-959      1174-1627
AVX-512 32   1449-1606    4159-5299    1639-1978    2759-3311
AVX-512 128  6006-7038    16818-17526  5434-6382    10164-11768
AVX2 1       181-185      671-674      --           1234-1313
AVX2 8       1760-1902    1496-1565    --           1718-2051
AVX2 32      4649-4932    4372-6018    --           3435-5041
AVX2 128     14169-17250  15931-20405  --           9746-12894
===========  ===========  ===========  ===========  ===========

The AVX2 rows above were measured before a fix of the fma path: a load through a ``double*`` made
GCC store every accumulator to the stack after each multiply-add, which halved its rate. Since then
(2 threads, one hot block, acting as AVX2 on the Zen 4), 576 -> 3072 ran 91, 131 and 172 G FLOP/s at
8, 32 and 128 rows against torch's int8 kernel's 79, 85 and 90, and 1536 -> 576 92, 120 and 148
against 84, 120 and 96.

Why: decode at 1-32 rows is bound by reading the weights, and int8 reads half of bf16's bytes (a
quarter of fp32's), so our kernel leads wherever the conversion keeps up: up to 2x packed bf16 at
1-8 rows on AVX-512 and 6x packed fp32 at 1 row on AVX2. At 128 rows every path is bound by its
multiply-adds; with one weight block hot in cache ours ran 95-108 G multiply-adds/s (the
``vdpbf16ps`` rate of one core) beside oneDNN's 60-113, so it is level with packed bf16 there,
and behind packed fp32 on AVX2 (the int8 -> fp32 conversion and 3-row tiles of 16 registers).
torch's int8 kernel dequantizes in the inner loop and is slower than ours at every size but AVX2's
8 rows, so one kernel serves every batch (which keeps every row's result independent of the batch).
Not done: activations quantized per row to int8 with VNNI (``vpdpbusd``, twice ``vdpbf16ps``'s
multiply-adds) for large batches (it changes the recipe: another policy), and oneDNN fp32 over
the dequantized weight for AVX2's 128 rows (exact: an int8 code times a bf16 scale fits fp32).

Weight updates: the bf16/fp32 parameters stay (updates land in them); :meth:`Int8Linear.update`
and :meth:`Int4Linear.update` re-quantize them into the layer's existing buffers, in place, on the
engine thread inside the commit (``FastDecoder.requantize`` through ``ModelRunner.refresh_weights``),
so no step ever runs with some layers of the old weights and some of the new, and no step runs the
unquantized model. Memory: the integer copy on top of the parameters (int8: half the linear weights'
bf16 bytes; int4: a quarter).

Re-quantization (our kernels): one vectorized C++ pass per weight into the packed layout
(``quantize_int8_packed``, ``quantize_int4_packed``), bit-equal to :func:`quantize_int8` and
:func:`quantize_int4` (tested); for a full SmolLM2-135M commit on the machine above, int8 0.06-0.10 s
and int4 0.09 s (in torch operations int4's took 0.35 s); ``noria bench sync`` measures both.

Not guaranteed: the same logprobs as the unquantized model (it is another policy, close to it:
pair with ``train.loss.off_policy: tis``, or train it as it is served with ``train.qat``);
bitwise-equal results across row counts with torch's kernels (where ours do not serve; ours are
batch-invariant within one path).

Deterministic mode and QAT (``engine.deterministic`` with int8 / int4, ``train.qat``): one recipe,
two sides. :class:`FakeQuant` gives a layer the weight the integer matmul computes with
(:func:`fake_quantize`: this module's quantizer on the weight held in the engine's dtype, then
dequantized), with a straight-through gradient. The trainer's decoder-block linears compute with it
(``train.qat``); the deterministic engine runs the same exact path with it instead of the integer
kernels (whose accumulation order no trainer repeats). So rollout and trainer logprobs are equal
bit for bit, and the trained policy is the quantized one; outside deterministic mode the engine's
kernels compute the same quantized weights in another order (differences at rounding level).
"""

from __future__ import annotations

import logging

import torch

from noria.models.quantize import (  # noqa: F401 - the recipes, re-exported: the engine's names for them
    CHUNK_ROWS, INT4_GROUP, MIN_SCALE, MODES, PACK_BLOCK, FakeQuant, dequantize_int4, dequantize_int8, fake_quantize,
    pack_int4_blocks, pack_int8, pack_int8_shape, quantize_int4, quantize_int8, set_fake_quant, unpack_int4_blocks, unpack_int8,
)

log = logging.getLogger(__name__)


def supported(model: torch.nn.Module, mode: str) -> str | None:
    """None if ``model`` can be served with ``mode`` weights here, else the reason it cannot."""
    if mode not in MODES:
        return f"unknown quantization {mode!r}; supported: {', '.join(MODES)}"
    first = next(model.parameters())
    if first.device.type != "cpu":
        return f"{mode} weights run on CPU kernels only (the model is on {first.device}); on CUDA use fp8"
    if first.dtype not in (torch.bfloat16, torch.float32):
        return f"{mode} serving needs a bfloat16 or float32 model, got {first.dtype}"
    if getattr(model.args, "moe_layers", None):
        return f"{mode} weights cover dense decoders only (MoE experts are not quantized)"
    op = "_weight_int8pack_mm" if mode == "int8" else "_weight_int4pack_mm_for_cpu"
    if not hasattr(torch.ops.aten, op):
        return f"this torch has no aten.{op}"
    if mode == "int4":
        for i, layer in enumerate(model.model.layers):
            for name, module in layer.named_modules():
                if isinstance(module, torch.nn.Linear) and (module.in_features % INT4_GROUP or module.out_features % 16):
                    return (f"model.layers.{i}.{name} has shape [{module.out_features}, {module.in_features}]; int4 "
                            f"needs output features a multiple of 16 and input features a multiple of {INT4_GROUP}")
    return None


def int4_grid_share(model: torch.nn.Module) -> tuple[float, float]:
    """(share of the first decoder block's linear weights within 5% of a step of their int4 code,
    the median step): near 1 for a model dequantized from a checkpoint on that grid (a Q4_1 GGUF's
    groups of 32 with a scale and a minimum are the int4 recipe's), near 0.1 for trained weights.
    A sample: the first :data:`CHUNK_ROWS` rows of each linear (a large model's block is gigabytes)."""
    shares, steps = [], []
    for module in model.model.layers[0].modules():
        if isinstance(module, torch.nn.Linear) and module.in_features % INT4_GROUP == 0:
            w = module.weight.detach()[:CHUNK_ROWS].float()
            q, scale, zero = quantize_int4(w, COMPUTE_DTYPE)
            step = scale.float().repeat_interleave(INT4_GROUP, dim=1)
            shares.append(((w - dequantize_int4(q, scale, zero)).abs() < 0.05 * step).float().flatten())
            steps.append(scale.float().flatten())
    if not shares:
        return 0.0, 0.0
    return torch.cat(shares).mean().item(), torch.cat(steps).median().item()


def warn_if_on_int4_grid(model: torch.nn.Module) -> None:
    """Log that int4 rollout will not follow training when the model's weights sit on the int4 grid."""
    share, step = int4_grid_share(model)
    if share > 0.5:
        log.warning(
            "engine.quantization=int4: %.0f%% of the first block's weights lie on the int4 grid (the model was "
            "dequantized from a 4-bit checkpoint, such as a Q4 GGUF): int4 serves it without loss, but an update "
            "reaches the rollout only when a weight moves half a step (median step %.3g), which at a fine-tuning "
            "learning rate takes thousands of steps; train it with engine.quantization: int8 (docs/engines.md, "
            "'Learning with quantized rollout')", 100 * share, step,
        )


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes, scales and zeros in the layout of ``aten._weight_int4pack_mm_for_cpu``: packed codes
    uint8 [N, K / 2] and scale/zero pairs [K / group, N, 2]."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return packed, torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()


# ---------------------------------------------------------------------------------------- layers


def _concat(weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat(weights) if len(weights) > 1 else weights[0]
    if all(b is None for b in biases):
        return weight, None
    return weight, torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])


COMPUTE_DTYPE = torch.bfloat16
"""The activations' dtype in the integer matmuls (and the scales' dtype), whatever the model's."""


class _QuantLinear:
    """``x @ cat(weights).T + cat(biases)`` with quantized weights; the fast decoder's layer
    interface (``sizes``, called on [..., K] activations, answering in their dtype)."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> None:
        self.sizes = [w.shape[0] for w in weights]
        self.dtype = COMPUTE_DTYPE
        self.bias: torch.Tensor | None = None
        self._install(*_concat(weights, biases))

    @torch.no_grad()
    def update(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> None:
        """Re-quantize new weights (same shapes) into this layer's buffers, in place."""
        weight, bias = _concat(weights, biases)
        self._requantize(weight)
        if bias is not None:
            self.bias.copy_(bias)

    @torch.no_grad()
    def _install(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        raise NotImplementedError

    def _requantize(self, weight: torch.Tensor) -> None:
        raise NotImplementedError

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x.reshape(-1, x.shape[-1]).contiguous())  # in x's dtype
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


def int8_kernel():
    """The C++ extension serving :class:`Int8Linear` and :class:`Int4Linear`, or None (not built here, or
    ``NORIA_NO_CPU_KERNEL=1``): then torch's ``_weight_int8pack_mm`` serves."""
    from noria.engine import kernels

    if not kernels.fused_kernels_enabled():
        return None
    module = kernels.cpu_kernel()
    return module if module is not None and module.int8_linear_path(0) else None


class Int8Linear(_QuantLinear):
    """Per-channel int8 weights through the C++ kernel (``kernels/int8_linear.cpp``, codes in its
    packed layout), or ``aten._weight_int8pack_mm`` where that kernel is not built or the shape is
    not a multiple of 16 outputs and 2 inputs."""

    path = 0
    """The kernel's path (0: the fastest that runs here; see ``int8_linear.cpp``); tests pin one."""

    def _install(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        n, k = weight.shape
        self.kernel = int8_kernel() if n % PACK_BLOCK == 0 and k % 2 == 0 else None
        if self.kernel is None:
            self.weight, self.scale = quantize_int8(weight, self.dtype)
        else:
            self.weight = torch.empty(pack_int8_shape(weight.shape), dtype=torch.int8)
            self.scale = torch.empty(n, dtype=self.dtype)
            self.scale_f32 = torch.empty(n, dtype=torch.float32)
            self._requantize(weight)
        self.bias = None if bias is None else bias.detach().clone()

    def _requantize(self, weight: torch.Tensor) -> None:
        if self.kernel is None:
            quantize_int8(weight, self.dtype, out=(self.weight, self.scale))
        elif weight.dtype in (torch.bfloat16, torch.float32):  # quantize_int8 in one C++ pass, packed
            self.kernel.quantize_int8_packed(weight.detach().contiguous(), self.weight, self.scale, self.scale_f32)
        else:
            quantize_int8(weight, self.dtype, out=(self.weight, self.scale), packed=True)
            self.scale_f32.copy_(self.scale)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:  # rounds x and the result to bf16 itself, answers in x's dtype
            return self.kernel.int8_linear(x, self.weight, self.scale_f32, self.path)
        return torch.ops.aten._weight_int8pack_mm(x.to(COMPUTE_DTYPE), self.weight, self.scale).to(x.dtype)

    def codes(self) -> torch.Tensor:
        """The int8 codes [N, K], whichever layout the kernel reads."""
        return unpack_int8(self.weight) if self.kernel is not None else self.weight

    def dequantized(self) -> torch.Tensor:
        return dequantize_int8(self.codes(), self.scale)


def int4_kernel(dtype: torch.dtype):
    """The C++ extension serving :class:`Int4Linear` for a ``dtype`` model, or None: ours serves bf16
    models on its AVX-512 BF16 path and every model on AVX2 (its fma path); on AVX-512 an fp32 model
    gets torch's ``_weight_int4pack_mm_for_cpu``, which measured faster there at 1-8 rows (see the
    module docstring)."""
    module = int8_kernel()
    if module is None:
        return None
    best = module.int8_linear_path(0)
    return module if (best == 1 and dtype == torch.bfloat16) or best == 2 else None


class Int4Linear(_QuantLinear):
    """Group-wise int4 weights through the C++ kernel (``kernels/int4_linear.cpp``, codes in its
    packed layout) where :func:`int4_kernel` serves, else ``aten._weight_int4pack_mm_for_cpu``."""

    path = 0
    """The kernel's path (0: the fastest that runs here; see ``int4_linear.cpp``); tests pin one."""

    def _install(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.kernel = int4_kernel(weight.dtype)
        if self.kernel is None:
            self.weight, self.scale_zero = pack_int4(*quantize_int4(weight, self.dtype))
        else:
            n, k = weight.shape
            self.weight = torch.empty(n // PACK_BLOCK, k // 2, PACK_BLOCK, dtype=torch.uint8)
            self.scale, self.zero = (torch.empty(n // PACK_BLOCK, k // INT4_GROUP, PACK_BLOCK) for _ in range(2))
            self._requantize(weight)
        self.bias = None if bias is None else bias.detach().clone()

    def _requantize(self, weight: torch.Tensor) -> None:
        if self.kernel is not None:  # quantize_int4 in one C++ pass, into the kernel's layout (bit-equal, tested)
            self.kernel.quantize_int4_packed(weight.detach().contiguous(), self.weight, self.scale, self.zero)
            return
        for buffer, value in zip((self.weight, self.scale_zero), pack_int4(*quantize_int4(weight, self.dtype))):
            buffer.copy_(value)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:  # rounds x and the result to bf16 itself, answers in x's dtype
            return self.kernel.int4_linear(x, self.weight, self.scale, self.zero, self.path)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(COMPUTE_DTYPE), self.weight, INT4_GROUP, self.scale_zero).to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        if self.kernel is not None:
            return dequantize_int4(*unpack_int4_blocks(self.weight, self.scale, self.zero))
        scale, zero = self.scale_zero.unbind(-1)
        q = _unpack_codes(self.weight, self.scale_zero.shape[1])
        return dequantize_int4(q, scale.t(), zero.t())


def _unpack_codes(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The int32 codes [N, K] of a packed int4 weight (through torch's own unpacking: the matmul of
    the identity), for references and tests."""
    k = packed.shape[1] * 2
    eye = torch.eye(k, dtype=torch.float32)
    ones = torch.stack([torch.ones(k // INT4_GROUP, n), torch.full((k // INT4_GROUP, n), 8.0)], dim=-1)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, INT4_GROUP, ones).t().round().to(torch.int32)


LAYERS = {"int8": Int8Linear, "int4": Int4Linear}
"""The quantized layer class of each mode."""
