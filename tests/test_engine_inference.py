"""The engine's fast CPU forward (fused, prepacked bf16 matmuls): same bits as the model, fresh after
every weight update, off where it must be. CPU only (the fast path exists only there)."""

from __future__ import annotations

import copy

import pytest
import torch

from noria.config import EngineConfig
from noria.engine import Engine, GenerateRequest, SamplingParams, inference
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


def random_bf16(args: ModelArgs, seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    model = DecoderLM(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.to(torch.bfloat16).eval()


@pytest.mark.parametrize("family", [{}, {"qkv_bias": True}, {"qk_norm": True}])
def test_fast_forward_equals_model_bitwise(family):
    model = random_bf16(tiny_args(**family))
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
            assert torch.equal(plain, mine), t
            assert torch.equal(model.lm_head(plain[0]), fast.lm_head(mine[0])), t


def test_fast_path_only_for_cpu_bf16_outside_deterministic_mode():
    assert not inference.supported(random_bf16(tiny_args()).float())
    config = dict(kv_cache_tokens=512, block_size=4)
    fast = Engine(random_bf16(tiny_args()), None, EngineConfig(**config))
    exact = Engine(random_bf16(tiny_args()), None, EngineConfig(**config, deterministic=True))
    assert fast.runner.fast is not None and exact.runner.fast is None
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


def test_engine_fast_path_gives_the_plain_tokens_and_logprobs():
    model = random_bf16(tiny_args())
    assert generate(model, fast=True) == generate(model, fast=False)  # logprobs bitwise


def perturbed(model: DecoderLM) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {n: t + 0.3 * torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in model.state_dict().items()
            if "layers.1." in n or n == "lm_head.weight"}


@pytest.mark.parametrize("source", ["state_dict", "disk"])
def test_weight_updates_refresh_the_packed_weights(source, tmp_path):
    model = random_bf16(tiny_args())
    engine = Engine(model, None, EngineConfig(kv_cache_tokens=2048, block_size=4))
    reqs = [GenerateRequest(input_ids=p, sampling=PARAMS) for p in PROMPTS]
    before = engine.generate_batch(reqs)
    update = perturbed(model)
    expected_model = copy.deepcopy(model)
    with torch.no_grad():
        for name, t in update.items():
            expected_model.state_dict()[name].copy_(t)
    if source == "state_dict":
        engine.update_weights_from_state_dict(update, version=1)
    else:
        save_model(expected_model, tmp_path / "ckpt")
        engine.update_weights_from_disk(tmp_path / "ckpt", version=1)
    after = [(o.output_ids, o.logprobs) for o in engine.generate_batch(reqs)]
    engine.shutdown(1)
    assert after != [(o.output_ids, o.logprobs) for o in before]
    assert after == generate(expected_model, fast=False)
