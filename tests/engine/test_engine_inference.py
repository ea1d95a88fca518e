"""The engine's fast CPU forward (fused, prepacked matmuls): the model's bits in bf16 (its rounding
in fp32), fresh after every weight update, off where it must be — deterministic mode, and bf16 on a
CPU where oneDNN has no bf16 kernels (AVX2-only: run this file under NORIA_CPU_ISA=avx2), where the
engine must still serve. CPU only (the fast path exists only there)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from noria.config import EngineConfig
from noria.engine import Engine, GenerateRequest, SamplingParams, inference
from noria.hardware import cpu_info
from noria.models import DecoderLM, save_model
from noria.models.attention import CausalContext
from noria.models.config import ModelArgs, RopeScaling

def tiny_args(qkv_bias: bool = False, qk_norm: bool = False) -> ModelArgs:
    return ModelArgs(
        model_type="qwen3" if qk_norm else "qwen2" if qkv_bias else "llama",
        vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=RopeScaling(), qkv_bias=qkv_bias,
        o_bias=False, mlp_bias=False, qk_norm=qk_norm, tie_word_embeddings=True, max_position_embeddings=512,
        bos_token_id=None, eos_token_ids=(2,),
    )


def random_model(args: ModelArgs, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    model = DecoderLM(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.to(dtype).eval()


def random_bf16(args: ModelArgs, seed: int = 0) -> DecoderLM:
    return random_model(args, torch.bfloat16, seed)


DTYPES = [torch.bfloat16, torch.float32]


def need_packed(dtype: torch.dtype) -> None:
    if not inference.hardware.packed_linear_ok(dtype):
        pytest.skip(f"oneDNN has no packed {dtype} linears on this CPU ({cpu_info().summary()}); "
                    "test_fast_path_only_where_onednn_packs_the_dtype covers it")  # fmt: skip


def assert_same(plain: torch.Tensor, mine: torch.Tensor, what) -> None:
    """bf16: the same bits; fp32: oneDNN's and MKL's summation orders differ, so the same to rounding."""
    if plain.dtype == torch.bfloat16:
        assert torch.equal(plain, mine), what
    else:
        torch.testing.assert_close(mine, plain, rtol=1e-5, atol=1e-5, msg=str(what))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", [{}, {"qkv_bias": True}, {"qk_norm": True}])
def test_fast_forward_equals_model(family, dtype):
    need_packed(dtype)
    model = random_model(tiny_args(**family), dtype)
    assert inference.supported(model)
    fast = inference.FastDecoder(model)
    # llama/qwen2 layers run the fused C++ norm/RoPE/SwiGLU kernels (kernels/fused.cpp); q/k-norm
    # layers the model's modules around the packed matmuls.
    assert (fast._fused_ops(model.model) is None) == bool(family.get("qk_norm"))
    for t in (1, 2, 7, 8, 31, 32, 64, 128, inference.MAX_ROWS, inference.MAX_ROWS + 40):
        ids = torch.randint(0, 300, (1, t), generator=torch.Generator().manual_seed(t))
        positions = torch.arange(t).unsqueeze(0)
        with torch.no_grad():
            plain = model.hidden_states(ids, positions)
            mine = fast.hidden_states(ids, positions, CausalContext())
            assert_same(plain, mine, t)
            assert_same(model.lm_head(plain[0]), fast.lm_head(mine[0]), t)


def test_fast_path_only_where_onednn_packs_the_dtype():
    # fp32 packs on every x86 CPU; bf16 only where oneDNN has bf16 kernels (not on AVX2-only CPUs,
    # where _reorder_linear_weight raises): there the engine runs the model's own modules.
    assert inference.supported(random_model(tiny_args(), torch.float32))
    assert inference.supported(random_bf16(tiny_args())) == cpu_info().onednn_bf16
    config = dict(kv_cache_tokens=512, block_size=4)
    for dtype in DTYPES:
        fast = Engine(random_model(tiny_args(), dtype), None, EngineConfig(**config))
        exact = Engine(random_model(tiny_args(), dtype), None, EngineConfig(**config, deterministic=True))
        assert (fast.runner.fast is not None) == inference.hardware.packed_linear_ok(dtype) and exact.runner.fast is None
        fast.shutdown(1)
        exact.shutdown(1)


PARAMS = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
PROMPTS = [[3 + (7 * i + s) % 290 for i in range(5 + 6 * s)] for s in range(5)]


def generate(model: DecoderLM, fast: bool, prompts=PROMPTS):
    engine = Engine(model, None, EngineConfig(kv_cache_tokens=2048, block_size=4, chunked_prefill_size=16))
    if not fast:
        engine.runner.fast = None
    outs = engine.generate_batch([GenerateRequest(input_ids=p, sampling=PARAMS) for p in prompts])
    engine.shutdown(1)
    return [(o.output_ids, o.logprobs) for o in outs]


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_serves_every_dtype_on_this_cpu(dtype):
    # The AVX2 crash: a bf16 engine must serve (slowly, through the model's modules) where oneDNN
    # refuses packed bf16.
    outs = generate(random_model(tiny_args(), dtype), fast=True)
    assert all(len(ids) == PARAMS.max_new_tokens for ids, _ in outs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_fast_path_gives_the_plain_tokens_and_logprobs(dtype):
    need_packed(dtype)
    model = random_model(tiny_args(), dtype)
    assert_same_outputs(generate(model, fast=True), generate(model, fast=False), dtype)


def assert_same_outputs(mine, plain, dtype):
    """bf16: bitwise; fp32: the same tokens, logprobs to rounding."""
    if dtype == torch.bfloat16:
        assert mine == plain  # logprobs bitwise
    else:
        assert [ids for ids, _ in mine] == [ids for ids, _ in plain]
        for (_, a), (_, b) in zip(mine, plain):
            assert a == pytest.approx(b, abs=1e-4)


def perturbed(model: DecoderLM) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {n: t + 0.3 * torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in model.state_dict().items()
            if "layers.1." in n or n == "lm_head.weight"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("source", ["state_dict", "disk"])
def test_weight_updates_refresh_the_packed_weights(source, dtype, tmp_path, monkeypatch):
    """The commit drops the packed copies and packs the new weights on a background thread: steps
    meanwhile run the model's modules on the new weights; then the new packs serve."""
    packing = threading.Event()
    install = inference.FastDecoder._install
    monkeypatch.setattr(inference.FastDecoder, "_install", lambda self, *a: (packing.wait(30), install(self, *a)))
    model = random_model(tiny_args(), dtype)
    engine = Engine(model, None, EngineConfig(kv_cache_tokens=2048, block_size=4, chunked_prefill_size=16))  # as generate()
    reqs = [GenerateRequest(input_ids=p, sampling=PARAMS) for p in PROMPTS]
    before = engine.generate_batch(reqs)
    update = perturbed(model)
    expected_model = copy.deepcopy(model)
    with torch.no_grad():
        for name, t in update.items():
            expected_model.state_dict()[name].copy_(t)
    if source == "state_dict":
        engine.weights.update_from_state_dict(update, version=1)
    else:
        save_model(expected_model, tmp_path / "ckpt")
        engine.weights.update_from_disk(tmp_path / "ckpt", version=1)
    fast = engine.runner.fast
    if fast is not None:  # still packing: the modules serve the new weights
        assert fast.packed is None
        during = [(o.output_ids, o.logprobs) for o in engine.generate_batch(reqs)]
        assert_same_outputs(during, generate(expected_model, fast=False), dtype)  # MKL's fp32 rounding follows alignment
        engine.flush_cache()  # its KV came from the modules (in fp32 not bitwise the packed path's)
    packing.set()
    if fast is not None:
        fast.wait_packed()
        assert fast.packed is not None
    after = [(o.output_ids, o.logprobs) for o in engine.generate_batch(reqs)]
    engine.shutdown(1)
    assert after != [(o.output_ids, o.logprobs) for o in before]
    # A fresh engine on the updated weights (its own packed copies, where this CPU packs the dtype).
    assert after == generate(expected_model, fast=True)
