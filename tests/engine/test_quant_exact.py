"""One quantization recipe for engine and trainer: an RL run whose engine serves int8 / int4 weights
in deterministic mode and whose trainer fake-quantizes the same way (``train.qat``) reports exact
agreement, rollout vs trainer logprobs equal bit for bit, before and after a weight sync (the
engine re-quantizes the new weights); without QAT the same run does not (the trainer then trains
the unquantized policy). Tiny random model, CPU."""

from __future__ import annotations

import pytest

from noria.config import ConfigError, load_config
from noria.launch.rl import run_rl
from rl_util import read_jsonl, rl_args


def diffs(model, run, **extra) -> list[float]:
    args = {"train.max_steps": 2, "engine.deterministic": True, "rollout.temperature": 0.8, **extra}
    run_rl(load_config(None, rl_args(model, **args)), run_dir=str(run), progress=False)
    return [row["rollout_logprob_abs_diff_max"] for row in read_jsonl(run / "metrics.jsonl")]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_qat_trainer_agrees_with_the_deterministic_integer_engine_bitwise(tiny_model_dir, tmp_path, mode):
    assert diffs(tiny_model_dir, tmp_path / "qat", **{"engine.quantization": mode, "train.qat": mode}) == [0.0, 0.0]
    if mode == "int8":  # the engine served another policy than the unquantized one the trainer holds
        assert min(diffs(tiny_model_dir, tmp_path / "plain", **{"engine.quantization": mode})) > 0.0


def test_qat_must_name_the_served_quantization(tiny_model_dir):
    with pytest.raises(ConfigError, match="train.qat is int8 but engine.quantization is none"):
        load_config(None, rl_args(tiny_model_dir, **{"train.qat": "int8"}))


def test_fake_quant_forward_is_the_dequantized_weight_and_its_gradient_passes_straight_through():
    import torch

    from noria.models.quantize import FakeQuant, fake_quantize

    weight = torch.randn(32, 64, requires_grad=True)
    out = FakeQuant("int4", torch.bfloat16)(weight)
    assert torch.equal(out.detach(), fake_quantize(weight, "int4", torch.bfloat16)) and not torch.equal(out.detach(), weight.detach())
    out.sum().backward()
    assert torch.equal(weight.grad, torch.ones_like(weight))
