"""Weight-only integer rollout (``engine.quantization: int8 | int4``, noria.engine.quant) on CPU: the
quantizers against their definitions, the integer layers against a dequantized reference matmul, an
engine serving them (close to the unquantized policy, equal to the quantized one), re-quantization
at a weight update (in place, equal to a fresh engine on the new weights), and the refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from noria.config import ConfigError, EngineConfig, from_dict
from noria.config.run import RunConfig
from noria.engine import Engine, GenerateRequest, HFEngine, SamplingParams, quant
from noria.models import load_model

PROMPTS = [[5, 9, 17, 33, 65, 129], [7, 3, 200, 41], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
NEW_TOKENS = 12


def make_engine(model, **overrides) -> Engine:
    settings = dict(kv_cache_tokens=1024, block_size=4, chunked_prefill_size=8)
    settings.update(overrides)
    return Engine(model, None, EngineConfig(**settings))


def greedy(engine, n: int = NEW_TOKENS):
    params = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
    return engine.generate_batch([GenerateRequest(input_ids=p, sampling=params) for p in PROMPTS])


def forced_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Log-probabilities of ``output`` after ``prompt`` under ``model``'s own modules, teacher-forced."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model.lm_head(model.hidden_states(ids)).float(), -1)[0]
    return logp[len(prompt) - 1 : -1].gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


def bf16_rounded(module, args, output=None):
    """A forward (pre-)hook: the integer layers' bf16 rounding of their inputs and outputs."""
    return output.bfloat16().float() if output is not None else (args[0].bfloat16().float(),)


def dequantized_copy(tiny_model_dir, engine: Engine):
    """A plain fp32 model whose decoder-block linears hold the engine's dequantized integer weights
    and round their inputs and outputs to bf16, as the integer kernels do."""
    ref = load_model(tiny_model_dir, dtype=torch.float32)
    for layer, packed in zip(ref.model.layers, engine.runner.fast.packed.layers):
        a, m = layer.self_attn, layer.mlp
        groups = [(packed.qkv, [a.q_proj, a.k_proj, a.v_proj]), (packed.o, [a.o_proj]),
                  (packed.gate_up, [m.gate_proj, m.up_proj]), (packed.down, [m.down_proj])]
        for qlinear, modules in groups:
            for module, w in zip(modules, qlinear.dequantized().split(qlinear.sizes)):
                module.weight.data.copy_(w)
                module.register_forward_pre_hook(bf16_rounded)
                module.register_forward_hook(bf16_rounded)
    return ref


# ---------------------------------------------------------------------------------------- quantizers


def test_int8_quantizer_is_symmetric_per_output_channel():
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 48)[:, None]
    original = w.clone()
    q, scale = quant.quantize_int8(w, torch.float32)
    assert torch.equal(w, original)  # the parameter it reads is left alone (fp32: no implicit copy)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    assert torch.equal(scale, w.abs().amax(1) / 127)
    assert q.abs().amax(1).eq(127).all() and q.min() >= -127  # every channel's largest weight maps to +-127
    err = (quant.dequantize_int8(q, scale) - w).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5)).all()  # round to nearest: half a step at most
    zero_row = quant.quantize_int8(torch.zeros(2, 8), torch.float32)
    assert (zero_row[0] == 0).all() and (zero_row[1] > 0).all()


def test_int4_quantizer_uses_the_group_range():
    g = quant.INT4_GROUP
    w = torch.randn(16, 4 * g, generator=torch.Generator().manual_seed(1)) * torch.logspace(-2, 1, 4).repeat_interleave(g)
    q, scale, zero = quant.quantize_int4(w, torch.float32)
    assert q.dtype == torch.int32 and scale.shape == zero.shape == (16, 4)
    assert q.min() == 0 and q.max() == 15
    groups = w.reshape(16, 4, g)
    assert torch.allclose(scale, (groups.amax(-1) - groups.amin(-1)) / 15)
    back = quant.dequantize_int4(q, scale, zero).reshape(16, 4, g)
    assert ((back - groups).abs() <= scale[..., None] / 2 * (1 + 1e-4) + 1e-6).all()
    # the packed layout holds the same codes
    packed, _ = quant.pack_int4(q, scale, zero)
    assert torch.equal(quant._unpack_codes(packed, 16), q)


@pytest.mark.parametrize("mode", quant.MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_equals_the_dequantized_matmul(mode, dtype):
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(n, 64, generator=g).to(dtype) for n in (64, 32, 32)]
    biases = [torch.randn(n, generator=g).to(dtype) for n in (64, 32, 32)]
    layer = quant.LAYERS[mode](weights, biases)
    x = torch.randn(3, 7, 64, generator=g).to(dtype)
    y = layer(x)
    assert y.shape == (3, 7, 128) and y.dtype == dtype and layer.sizes == [64, 32, 32]
    # bf16 activations whatever the model dtype; the tolerance is the bf16 output's own rounding
    ref = x.bfloat16().float() @ layer.dequantized().t() + torch.cat(biases).float()
    tol = 6e-2
    assert torch.allclose(y.float(), ref, rtol=1e-2, atol=tol)
    # a quantized product, not the plain one
    assert not torch.allclose(y.float(), F.linear(x.float(), torch.cat(weights).float(), torch.cat(biases).float()), atol=tol)


# ---------------------------------------------------------------------------------------- engine


@pytest.mark.parametrize("mode,max_diff", [("int8", 0.05), ("int4", 0.5)])
def test_engine_serves_the_quantized_policy_close_to_the_plain_one(tiny_model_dir, mode, max_diff):
    model = load_model(tiny_model_dir, dtype=torch.float32)
    plain = greedy(make_engine(load_model(tiny_model_dir, dtype=torch.float32)))
    engine = make_engine(model, quantization=mode)
    try:
        assert isinstance(engine.runner.fast.packed.layers[0].qkv, quant.LAYERS[mode])
        out = greedy(engine)
        reference = dequantized_copy(tiny_model_dir, engine)
        engine.runner.fast.max_rows = 4  # prefill chunks of 8 rows: the long-step path
        long_steps = greedy(engine)
    finally:
        engine.shutdown(1)
    same = sum(a == b for o, p in zip(out, plain) for a, b in zip(o.output_ids, p.output_ids))
    assert same >= 0.75 * len(PROMPTS) * NEW_TOKENS
    for prompt, o, p, long in zip(PROMPTS, out, plain, long_steps):
        # close to the unquantized policy on the quantized engine's own tokens ...
        gap = (forced_logprobs(model, prompt, o.output_ids) - torch.tensor(o.logprobs)).abs().max()
        assert 1e-4 < gap < max_diff
        # ... and equal, to fp32 rounding, to the dequantized model's (measured: <= 2e-6)
        assert torch.allclose(forced_logprobs(reference, prompt, o.output_ids), torch.tensor(o.logprobs), atol=2e-5)
        # steps longer than the packed path's rows run the integer layers too (never the plain modules)
        assert long.output_ids == o.output_ids
        assert torch.allclose(torch.tensor(long.logprobs), torch.tensor(o.logprobs), atol=1e-4)


@pytest.mark.parametrize("mode", quant.MODES)
def test_weight_update_requantizes_in_place(tiny_model_dir, mode):
    model = load_model(tiny_model_dir, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    new = {name: (p.detach().float() * 1.5 + 0.02 * torch.randn(p.shape, generator=g)).bfloat16()
           for name, p in model.named_parameters() if name.startswith("model.layers.")}
    engine = make_engine(model, quantization=mode)
    try:
        before = greedy(engine)
        qkv = engine.runner.fast.packed.layers[1].qkv
        buffer, old_codes = qkv.weight.data_ptr(), qkv.weight.clone()
        engine.weights.update_from_state_dict(new, version=1)
        assert qkv.weight.data_ptr() == buffer and not torch.equal(qkv.weight, old_codes)  # re-quantized in place
        assert engine.runner.fast.packed.layers[1].qkv is qkv
        after = greedy(engine)
        assert all(r.weight_versions == [1] * NEW_TOKENS for r in after)
    finally:
        engine.shutdown(1)
    fresh_model = load_model(tiny_model_dir, dtype=torch.bfloat16)
    fresh_model.load_state_dict(new, strict=False)
    fresh = make_engine(fresh_model, quantization=mode)
    try:
        expected = greedy(fresh)
    finally:
        fresh.shutdown(1)
    assert [r.logprobs for r in after] != [r.logprobs for r in before]
    assert [r.output_ids for r in after] == [r.output_ids for r in expected]
    assert [r.logprobs for r in after] == [r.logprobs for r in expected]


def test_int4_warns_when_the_weights_already_lie_on_its_grid(tiny_model_dir, caplog):
    """A model dequantized from a 4-bit checkpoint (SmolLM2 from its Q4_1 GGUF) is served by int4
    without loss, and a fine-tuning update never moves a weight to another code: said at engine start."""
    model = load_model(tiny_model_dir, dtype=torch.float32)
    share, step = quant.int4_grid_share(model)
    assert share < 0.3 and step > 0  # trained weights: about 10% within 5% of a step of a code
    with torch.no_grad():
        for layer in model.model.layers:
            for module in layer.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(quant.fake_quantize(module.weight, "int4", torch.bfloat16))
    assert quant.int4_grid_share(model)[0] > 0.99
    with caplog.at_level("WARNING", logger="noria.engine.quant"):
        make_engine(model, quantization="int4").shutdown(1)
    assert "lie on the int4 grid" in caplog.text and "engine.quantization: int8" in caplog.text


# ---------------------------------------------------------------------------------------- refusals


def test_quantization_refusals(tiny_model_dir):
    with pytest.raises(ConfigError, match="engine.quantization=fp8 cannot be combined with engine.deterministic"):
        EngineConfig(quantization="fp8", deterministic=True).validate()
    for mode in quant.MODES:
        EngineConfig(quantization=mode, deterministic=True).validate()  # exact, with train.qat (tests/engine/test_quant_exact.py)
        with pytest.raises(ConfigError, match=rf"engine.quantization={mode} runs on CPU only.*supported on CUDA: none, fp8"):
            EngineConfig(quantization=mode).check_model("cuda:0", "auto")
        with pytest.raises(ConfigError, match=f"engine.quantization={mode} needs the built-in engine's native model"):
            EngineConfig(quantization=mode).check_model("cpu", "hf")
        with pytest.raises(ValueError, match=f"engine.quantization={mode}: .*generic transformers engine"):
            HFEngine.from_path(tiny_model_dir, EngineConfig(quantization=mode))
    EngineConfig(quantization="fp8").check_model("cuda", "auto")  # fp8 is CUDA's
    with pytest.raises(ConfigError, match=r"engine.quantization: 'int3' is not one of \['none', 'fp8', 'int8', 'int4'\]"):
        from_dict(EngineConfig, {"quantization": "int3"}, "engine")
    run = from_dict(RunConfig, {"model": {"path": str(tiny_model_dir), "device": "cuda"}, "data": {"task": "arithmetic"},
                                "engine": {"quantization": "int8"}})
    with pytest.raises(ConfigError, match=r"engine.quantization=int8 runs on CPU only \(model.device is cuda\)"):
        run.validate()
    with pytest.raises(ValueError, match="engine.quantization=int4: .*float16"):
        make_engine(load_model(tiny_model_dir, dtype=torch.float16), quantization="int4")
