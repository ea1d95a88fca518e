"""Helpers of the exact-agreement tests (tests/engine/test_exact_agreement.py, test_exact_cuda.py,
tests/distill/test_opd.py): a tiny random model folder per native family, a seeded batched
rollout on the deterministic engine (the prefix cache included), a trainer on it, and the check that
the trainer's step-0 logprobs equal the engine's rollout logprobs bit for bit."""

from __future__ import annotations

import math

import torch

from noria.config import EngineConfig, TrainConfig
from noria.engine import Engine, GenerateRequest, SamplingParams
from noria.models import DecoderLM, load_model, save_model
from noria.models.config import ModelArgs, RopeScaling
from noria.train.fsdp import FSDPBackend
from noria.train.packing import pack_samples
from noria.types import Sample

FAMILIES = {
    "llama": dict(qkv_bias=False, qk_norm=False, tie_word_embeddings=True),
    "qwen2": dict(qkv_bias=True, qk_norm=False, tie_word_embeddings=False),
    "qwen3": dict(qkv_bias=False, qk_norm=True, tie_word_embeddings=False),
}
VOCAB = 300
# Prompts of different lengths, batched together: above 24 tokens a prompt is prefilled in chunks
# that share steps with other requests, above 32 rows a linear layer is cut in pieces, above 64
# keys attention spans several key blocks, and a 150-token sequence two of the trainer's query
# blocks.
PROMPT_LENS = [3, 11, 40, 70, 134]


def tiny_folder(family: str, root) -> str:
    args = ModelArgs(
        model_type=family, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=RopeScaling(),
        o_bias=False, mlp_bias=False, max_position_embeddings=512, bos_token_id=None, eos_token_ids=(2,),
        **FAMILIES[family],
    )
    torch.manual_seed(0)
    model = DecoderLM(args)
    with torch.no_grad():  # fp32 weights that bf16 cannot hold exactly, norms away from 1
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return str(save_model(model, root / family))


def rollout(
    folder, deterministic: bool, prompt_lens=PROMPT_LENS, new_tokens: int = 16, device: str = "cpu", dtype=torch.bfloat16
) -> list[Sample]:
    """Generate from all prompts in one batch (temperature 1, seeded), then two more samples of the
    last prompt through the prefix cache; return them all as Samples."""
    config = EngineConfig(
        kv_cache_tokens=4096, block_size=4, chunked_prefill_size=24, max_batch_tokens=48,
        attention="torch", deterministic=deterministic,
    )
    engine = Engine(load_model(folder, dtype=dtype, device=device), None, config)
    vocab = engine.model.args.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in prompt_lens]
    outs = engine.generate_batch([request(p, new_tokens, seed) for seed, p in enumerate(prompts)])
    # More samples of the longest prompt, as an RL group has: served from the prefix cache.
    again = engine.generate_batch([request(prompts[-1], new_tokens, 100 + i) for i in range(2)])
    assert all(o.cached_tokens > 0 for o in again)
    prompts, outs = prompts + [prompts[-1]] * 2, outs + again
    engine.shutdown(1)
    return [
        Sample(prompt_ids=p, response_ids=o.output_ids, loss_mask=[1] * len(o.output_ids),
               rollout_logprobs=o.logprobs, weight_versions=o.weight_versions)
        for p, o in zip(prompts, outs)
    ]


def request(prompt: list[int], new_tokens: int, seed: int) -> GenerateRequest:
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=seed)
    return GenerateRequest(input_ids=prompt, sampling=params)


def trainer(folder, deterministic: bool, device: str = "cpu", dtype: str = "bfloat16", **overrides) -> FSDPBackend:
    cfg = TrainConfig(param_dtype=dtype, algorithm="rl", device=device, **overrides)
    cfg.optim.lr = 1e-5
    backend = FSDPBackend(cfg, deterministic=deterministic)
    backend.init(folder)
    return backend


def k3(rollout_lp: torch.Tensor, trainer_lp: torch.Tensor) -> torch.Tensor:
    d = trainer_lp - rollout_lp
    return torch.exp(d) - d - 1


def assert_exact_at_step_0(folder, micro_batch_tokens: int = 4096, device: str = "cpu", dtype: str = "bfloat16") -> None:
    samples = rollout(folder, deterministic=True, device=device, dtype=getattr(torch, dtype))
    batch = pack_samples(samples, torch.linspace(-1, 1, len(samples)).tolist())
    backend = trainer(folder, deterministic=True, device=device, dtype=dtype, micro_batch_tokens=micro_batch_tokens,
                      logprob_chunk_tokens=50)
    trained = batch.loss_mask > 0
    lp = backend.compute_logprobs(batch).logprobs[trained]
    rollout_lp = batch.rollout_logprobs[trained]
    assert (lp - rollout_lp).abs().max().item() == 0.0
    assert k3(rollout_lp, lp).max().item() == 0.0
    # train_step without old_logprobs takes its own (autograd) forward as old: the same bits.
    metrics = backend.train_step(batch)
    assert metrics["rollout_logprob_abs_diff_max"] == 0.0
    assert metrics["rollout_logprob_abs_diff"] == 0.0
    assert metrics["rollout_kl"] == 0.0
    assert metrics["skipped"] == 0.0 and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
