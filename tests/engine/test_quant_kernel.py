"""The C++ weight-only int8 linear (``noria/engine/kernels/int8_linear.cpp``) behind
``engine.quantization: int8``: every path that runs on this CPU against a float64 reference over the
dequantized weight (bf16-rounded activations, one bf16 rounding of the result), batch invariance,
the packed layout, and its refusals. Run natively and with ``NORIA_CPU_ISA=avx2`` (acting as an
AVX2-only CPU: the fma and scalar paths, the AVX-512 one refused)."""

from __future__ import annotations

import pytest
import torch

from noria import hardware
from noria.engine import quant
from noria.engine.kernels import cpu_kernel

PATHS = {1: "avx512_bf16", 2: "fma", 3: "scalar"}


@pytest.fixture(scope="module")
def kernel():
    module = cpu_kernel()
    if module is None:
        pytest.skip("the C++ CPU kernels are not built here")
    return module


def running_paths(module) -> list[int]:
    return [p for p in PATHS if module.int8_linear_path(p)]


def quantized(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed codes, fp32 scales, the dequantized fp32 weight) of a random [n, k] weight."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n)[:, None]
    q, scale = quant.quantize_int8(w, torch.bfloat16)
    return quant.pack_int8(q).contiguous(), scale.float(), quant.dequantize_int8(q, scale)


def test_paths_this_cpu_runs(kernel):
    paths = running_paths(kernel)
    assert 3 in paths  # the portable loop runs everywhere
    info = hardware.cpu_info()
    assert (1 in paths) == (hardware.kernel_isa() == "avx512" and info.has("avx512_bf16"))
    assert (2 in paths) == (hardware.kernel_isa() in ("avx512", "avx2"))
    assert kernel.int8_linear_path(0) == paths[0]  # auto: the first that runs, AVX-512 BF16 before FMA


@pytest.mark.parametrize("n,k", [(16, 2), (48, 64), (576, 576), (96, 1536)])
def test_every_path_equals_the_dequantized_matmul(kernel, n, k):
    w, scale, dequantized = quantized(n, k, seed=n + k)
    g = torch.Generator().manual_seed(k)
    for rows in (1, 2, 4, 12, 13, 40):  # one tile, tails, several tiles (weights converted once)
        x32 = torch.randn(rows, k, generator=g) * 3
        ref = x32.bfloat16().double() @ dequantized.double().t()
        bound = ref.abs() * 2.0**-8 + 1e-6 * ref.abs().max()  # one bf16 rounding (2^-9) + fp32 sums
        for path in running_paths(kernel):
            for x in (x32, x32.bfloat16()):
                y = kernel.int8_linear(x, w, scale, path)
                assert y.dtype == x.dtype and y.shape == (rows, n)
                assert torch.equal(y.float(), y.float().bfloat16().float()), "results are rounded to bf16"
                err = (y.double() - ref).abs()
                assert (err <= bound).all(), f"{PATHS[path]} rows={rows} [{n}, {k}] {x.dtype}: max error {err.max().item():.3g}"


def test_each_row_is_independent_of_the_batch(kernel):
    w, scale, _ = quantized(64, 128, seed=3)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    for path in running_paths(kernel):
        batch = kernel.int8_linear(x, w, scale, path)
        for row in (0, 12, 39):
            assert torch.equal(kernel.int8_linear(x[row : row + 1], w, scale, path), batch[row : row + 1]), PATHS[path]
        assert torch.equal(kernel.int8_linear(x[12:25].contiguous(), w, scale, path), batch[12:25]), PATHS[path]


def test_packed_layout_round_trips_and_the_layer_uses_the_kernel(kernel):
    q = torch.randint(-127, 128, (48, 10), dtype=torch.int8, generator=torch.Generator().manual_seed(5))
    packed = quant.pack_int8(q)
    assert packed.shape == (3, 5, 32)
    assert torch.equal(packed[1, 2, :2], q[16, 4:6]) and torch.equal(packed[1, 2, 30:], q[31, 4:6])
    assert torch.equal(quant.unpack_int8(packed), q)

    g = torch.Generator().manual_seed(6)
    weights = [torch.randn(32, 64, generator=g), torch.randn(16, 64, generator=g)]
    layer = quant.Int8Linear(weights, [None, None])
    assert layer.kernel is not None and layer.weight.shape == (3, 32, 32)
    codes, scale = quant.quantize_int8(torch.cat(weights), torch.bfloat16)
    assert torch.equal(layer.codes(), codes) and torch.equal(layer.scale, scale)
    # re-quantization writes the new codes into the same packed buffer
    buffer = layer.weight.data_ptr()
    new = [w.flip(1) for w in weights]
    layer.update(new, [None, None])
    assert layer.weight.data_ptr() == buffer and torch.equal(layer.codes(), quant.quantize_int8(torch.cat(new), torch.bfloat16)[0])
    # a shape the kernel does not take (outputs not a multiple of 16) keeps torch's kernel
    assert quant.Int8Linear([torch.randn(8, 64, generator=g)], [None]).kernel is None


def test_bad_input_is_refused(kernel):
    w, scale, _ = quantized(32, 64, seed=7)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="x has 62 input features, w 64"):
        kernel.int8_linear(torch.randn(2, 62), w, scale, 0)
    with pytest.raises(RuntimeError, match="x must be bfloat16 or float32"):
        kernel.int8_linear(x.half(), w, scale, 0)
    with pytest.raises(RuntimeError, match=r"scale must be float32 \[32\]"):
        kernel.int8_linear(x, w, scale.bfloat16(), 0)
    with pytest.raises(RuntimeError, match="w must be packed int8"):
        kernel.int8_linear(x, w.reshape(32, 64), scale, 0)
    missing = [p for p in PATHS if not kernel.int8_linear_path(p)] + [9]
    with pytest.raises(RuntimeError, match=f"path {missing[0]} does not run"):
        kernel.int8_linear(x, w, scale, missing[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_packing_quantizer_equals_the_python_definition_bit_for_bit(kernel, dtype):
    g = torch.Generator().manual_seed(8)
    w = (torch.randn(64, 1538, generator=g) * torch.logspace(-6, 2, 64)[:, None]).to(dtype)
    w[3] = 0  # an all-zero row: the scale floor
    w[7] = torch.arange(1538) % 254 - 126.5  # amax 126.5 -> every quotient a tie (and the scalar tail's too)
    w[7, 0] = 127
    w[5, :8] = torch.tensor([127, -127, 63.5, -63.5, 0.5, 1.5, 2.5, -2.5])  # amax 127: scale 1, ties to even
    q, scale = quant.quantize_int8(w, torch.bfloat16)
    packed, s16, s32 = torch.empty(4, 769, 32, dtype=torch.int8), torch.empty(64, dtype=torch.bfloat16), torch.empty(64)
    kernel.quantize_int8_packed(w, packed, s16, s32)
    assert torch.equal(s16, scale) and torch.equal(s32, scale.float())
    assert torch.equal(quant.unpack_int8(packed), q)
    assert torch.equal(q[5, :8], torch.tensor([127, -127, 64, -64, 0, 2, 2, -2], dtype=torch.int8))
    with pytest.raises(RuntimeError, match=r"\[60, 1538\] is not a multiple of \[16, 2\]"):
        kernel.quantize_int8_packed(w[:60].contiguous(), packed, s16, s32)


# ------------------------------------------------------------------------------------- int4


def quantized4(n: int, k: int, seed: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """((packed codes, scales, zeros) in the kernel's layout, the dequantized fp32 weight)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n)[:, None] + 0.05 * torch.randn(n, 1, generator=g)
    q, scale, zero = quant.quantize_int4(w, torch.bfloat16)
    return quant.pack_int4_blocks(q, scale, zero), quant.dequantize_int4(q, scale, zero)


@pytest.mark.parametrize("n,k", [(16, 32), (48, 64), (576, 576), (96, 1536)])
def test_int4_every_path_equals_the_dequantized_matmul(kernel, n, k):
    """The recipe's fp32 weights on the fma and scalar paths; on the AVX-512 BF16 path, those weights
    rounded to bf16 (bf16 activations only: fp32 ones go to the fma path, path 1 named refuses them)."""
    (w, scale, zero), dequantized = quantized4(n, k, seed=n + k)
    g = torch.Generator().manual_seed(k)
    for rows in (1, 2, 4, 12, 13, 40):
        x32 = torch.randn(rows, k, generator=g) * 3
        for path in running_paths(kernel):
            weight = dequantized.bfloat16().double() if path == 1 else dequantized.double()
            ref = x32.bfloat16().double() @ weight.t()
            bound = ref.abs() * 2.0**-8 + 1e-6 * ref.abs().max()
            for x in (x32.bfloat16(), x32) if path != 1 else (x32.bfloat16(),):
                y = kernel.int4_linear(x, w, scale, zero, path)
                assert y.dtype == x.dtype and y.shape == (rows, n)
                assert torch.equal(y.float(), y.float().bfloat16().float()), "results are rounded to bf16"
                err = (y.double() - ref).abs()
                assert (err <= bound).all(), f"{PATHS[path]} rows={rows} [{n}, {k}] {x.dtype}: max error {err.max().item():.3g}"
    if 1 in running_paths(kernel):
        with pytest.raises(RuntimeError, match="path 1 .* takes bfloat16 activations"):
            kernel.int4_linear(torch.randn(1, k), w, scale, zero, 1)
        assert torch.equal(kernel.int4_linear(x32, w, scale, zero, 0), kernel.int4_linear(x32, w, scale, zero, 2))


def test_int4_rows_are_independent_of_the_batch_and_the_layer_uses_the_kernel(kernel):
    (w, scale, zero), _ = quantized4(64, 128, seed=3)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    for path in running_paths(kernel):
        batch = kernel.int4_linear(x, w, scale, zero, path)
        for row in (0, 12, 39):
            assert torch.equal(kernel.int4_linear(x[row : row + 1], w, scale, zero, path), batch[row : row + 1]), PATHS[path]

    q = torch.randint(0, 16, (32, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(5))
    s, z = torch.rand(32, 2).bfloat16(), torch.randn(32, 2).bfloat16()
    codes, sb, zb = quant.pack_int4_blocks(q, s, z)
    assert codes.shape == (2, 32, 16) and codes.dtype == torch.uint8 and sb.shape == zb.shape == (2, 2, 16)
    assert codes[1, 3, 2].item() == q[18, 6].item() | q[18, 7].item() << 4
    assert all(torch.equal(a, b) for a, b in zip(quant.unpack_int4_blocks(codes, sb, zb), (q, s.float(), z.float())))

    g = torch.Generator().manual_seed(6)
    weights = [torch.randn(32, 64, generator=g).bfloat16(), torch.randn(16, 64, generator=g).bfloat16()]
    ours_fp32 = kernel.int8_linear_path(0) == 2  # AVX2: ours serves every model (its fma path)
    fp32_layer = quant.Int4Linear([w.float() for w in weights], [None, None])
    assert (fp32_layer.kernel is not None) == ours_fp32  # AVX-512 fp32 models: torch's kernel (faster there at 1-8 rows)
    layer = quant.Int4Linear(weights, [None, None])
    if kernel.int8_linear_path(0) not in (1, 2):  # neither the AVX-512 BF16 nor the fma path: torch's kernel
        assert layer.kernel is None
        return
    assert layer.kernel is not None and layer.weight.shape == (3, 32, 16)
    assert torch.equal(layer.dequantized(), quant.dequantize_int4(*quant.quantize_int4(torch.cat(weights), torch.bfloat16)))
    buffer, new = layer.weight.data_ptr(), [w.flip(1) for w in weights]
    layer.update(new, [None, None])  # re-quantization writes into the same buffers
    assert layer.weight.data_ptr() == buffer
    assert torch.equal(layer.dequantized(), quant.dequantize_int4(*quant.quantize_int4(torch.cat(new), torch.bfloat16)))


def test_int4_bad_input_is_refused(kernel):
    (w, scale, zero), _ = quantized4(32, 64, seed=7)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="x has 32 input features, w 64"):
        kernel.int4_linear(torch.randn(2, 32), w, scale, zero, 0)
    with pytest.raises(RuntimeError, match="x must be bfloat16 or float32"):
        kernel.int4_linear(x.half(), w, scale, zero, 0)
    with pytest.raises(RuntimeError, match=r"scale and zero must be float32 \[2, 2, 16\]"):
        kernel.int4_linear(x, w, scale, zero.transpose(1, 2).contiguous(), 0)
    with pytest.raises(RuntimeError, match="w must be packed uint8"):
        kernel.int4_linear(x, w.view(torch.int8), scale, zero, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_int4_packing_quantizer_equals_the_python_definition_bit_for_bit(kernel, dtype):
    g = torch.Generator().manual_seed(9)
    w = (torch.randn(48, 1536, generator=g) * torch.logspace(-6, 2, 48)[:, None] + torch.randn(48, 1, generator=g)).to(dtype)
    w[3] = 0  # all-zero groups: the scale floor
    w[7, :32] = torch.arange(32) % 16 * 0.5 - 3.75  # on a grid of step 0.5 from -3.75 (codes 0..15, halfway points below)
    w[7, 32:64] = torch.arange(32) % 16 * 0.5 - 3.5  # min -3.5: every (w - lo) / scale an integer
    w[9, :32] = torch.linspace(-1, 1, 32)  # a range whose scale rounds in bf16: quotients near .5
    expected = quant.pack_int4_blocks(*quant.quantize_int4(w, torch.bfloat16))
    got = (torch.empty(3, 768, 16, dtype=torch.uint8), torch.empty(3, 48, 16), torch.empty(3, 48, 16))
    kernel.quantize_int4_packed(w, *got)
    for name, a, b in zip(("codes", "scales", "zeros"), got, expected):
        assert torch.equal(a, b), name
    with pytest.raises(RuntimeError, match=r"\[48, 1530\] is not a multiple of \[16, 32\]"):
        kernel.quantize_int4_packed(w[:, :1530].contiguous(), *got)
