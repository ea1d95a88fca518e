"""The compact AdamW (train.optim.state_dtype bfloat16 / int8): state memory, fidelity to fp32 AdamW,
a real descent on a tiny model, and a checkpoint round trip."""

from __future__ import annotations

import pytest
import torch

from noria.config import OptimConfig, TrainConfig
from noria.config.schema import ConfigError
from noria.train.compact_adamw import BLOCK, CompactAdamW, code_table, dequantize, dynamic_map, quantize_into, state_bytes
from noria.train.optim import build_optimizer


def test_dynamic_map_is_sorted_256_values_with_zero_and_one():
    for signed in (True, False):
        q = dynamic_map(signed)
        assert q.numel() == 256 and bool((q[1:] > q[:-1]).all())
        assert 0.0 in q.tolist() and q.max() == 1.0
        assert (q.min() == -q[q < 0].abs().max()) if signed else q.min() == 0.0
        table = code_table(q)  # bf16 bit pattern -> nearest entry, as a binary search finds it
        x = torch.rand(10000) * (2 if signed else 1) - (1 if signed else 0)
        x16 = x.to(torch.bfloat16)
        by_table = table[x16.view(torch.int16).int() & 0xFFFF].long()
        assert torch.equal(by_table, torch.bucketize(x16.float(), (q[1:] + q[:-1]) / 2))


def test_block_quantization_keeps_each_value_within_the_maps_relative_step():
    torch.manual_seed(0)
    x = torch.randn(5 * BLOCK + 17) * torch.logspace(-3, 0, 5 * BLOCK + 17)  # a tail block, wide range
    qmap = dynamic_map(True)
    codes, scales = torch.empty(x.numel(), dtype=torch.uint8), torch.empty(6)
    quantize_into(x, codes, scales, code_table(qmap))
    back = dequantize(codes, scales, qmap)
    block_max = torch.nn.functional.pad(x.abs(), (0, 6 * BLOCK - x.numel())).view(6, BLOCK).amax(1)
    assert torch.allclose(scales, block_max)
    err = (back - x).abs() / block_max.repeat_interleave(BLOCK)[: x.numel()]
    assert float(err.max()) < 0.02  # the map's largest step near 1 is ~0.03 of the block max (half of it)
    big = x.abs() > 0.1 * block_max.repeat_interleave(BLOCK)[: x.numel()]
    assert float(((back - x).abs() / x.abs())[big].max()) < 0.1


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.05) for s in [(64, 512), (300, 70), (32,)]]


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 0.02), (torch.int8, 0.05)])
def test_updates_follow_fp32_adamw(dtype, tol):
    ref, ours = _params(1), _params(1)
    opt_ref = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.01)
    opt = CompactAdamW(ours, lr=1e-3, weight_decay=0.01, state_dtype=dtype)
    g = torch.Generator().manual_seed(2)
    start = [p.detach().clone() for p in ref]
    for _ in range(20):
        for a, b in zip(ref, ours):
            grad = torch.randn(a.shape, generator=g) * 1e-2 + 3e-3  # a drift the moments must carry
            a.grad, b.grad = grad.clone(), grad.clone()
        opt_ref.step()
        opt.step()
    for a, b, s in zip(ref, ours, start):
        moved_ref, moved = a.detach() - s, b.detach() - s
        rel = float((moved - moved_ref).norm() / moved_ref.norm())
        assert rel < tol, (dtype, a.shape, rel)


def test_int8_state_is_about_a_quarter_of_fp32():
    big = [torch.nn.Parameter(torch.zeros(1024, 1024))]
    for p in big:
        p.grad = torch.randn_like(p)
    fp32 = torch.optim.AdamW(big, lr=1e-3)
    fp32.step()
    int8 = CompactAdamW(big, lr=1e-3, state_dtype=torch.int8)
    int8.step()
    bf16 = CompactAdamW(big, lr=1e-3, state_dtype=torch.bfloat16)
    bf16.step()
    n = 1024 * 1024
    assert state_bytes(fp32) >= 8 * n
    assert state_bytes(bf16) <= 4 * n + 64
    assert state_bytes(int8) <= 2 * n + 2 * 4 * (n // BLOCK) + 64  # two bytes + two fp32 scales per block


def test_int8_adamw_reduces_the_loss_of_a_tiny_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    x = torch.randn(256, 32)
    y = (x[:, :4].sum(1, keepdim=True)).tanh()
    cfg = OptimConfig(lr=3e-3, state_dtype="int8")
    opt = build_optimizer(model.parameters(), cfg)
    assert isinstance(opt, CompactAdamW) and opt.state_dtype == torch.int8
    first = None
    for _ in range(150):
        loss = torch.nn.functional.mse_loss(model(x), y)
        first = first if first is not None else float(loss.detach())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert "exp_avg_scale" in opt.state[model[0].weight]  # 8192 values: quantized
    assert "exp_avg_sq" in opt.state[model[2].weight]  # 256 values: fp32 moments
    assert float(loss.detach()) < 0.2 * first


def test_checkpoint_round_trip_restores_the_quantized_state(tmp_path):
    from noria.train.checkpoint import load_checkpoint, save_checkpoint

    model = torch.nn.Linear(128, 64)
    opt = CompactAdamW(model.parameters(), lr=1e-3, state_dtype=torch.int8)
    for _ in range(2):
        model(torch.randn(4, 128)).sum().backward()
        opt.step()
        opt.zero_grad()
    before = {k: v.clone() for k, v in opt.state[model.weight].items()}
    folder = save_checkpoint(tmp_path / "ck", model, opt, {"optimizer_steps": 2})
    model2 = torch.nn.Linear(128, 64)
    opt2 = CompactAdamW(model2.parameters(), lr=1e-3, state_dtype=torch.int8)
    load_checkpoint(folder, model2, opt2)
    after = opt2.state[model2.weight]
    assert set(after) == set(before)
    for k in before:
        assert torch.equal(after[k], before[k]), k
    assert torch.equal(model2.weight, model.weight)


def test_compact_state_needs_the_single_backend():
    cfg = TrainConfig(backend="fsdp2", world_size=2, optim=OptimConfig(state_dtype="int8"))
    with pytest.raises(ConfigError, match="state_dtype"):
        cfg.validate()
    TrainConfig(optim=OptimConfig(state_dtype="bfloat16")).validate()
