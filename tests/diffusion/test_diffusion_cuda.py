"""Image models on CUDA: the engine and the trainer follow model.device / train.device and the dtype
(bf16), a batch-invariant trajectory is bit for bit the same in any batch, the trainer recomputes
the engine's log-probabilities exactly in deterministic mode (Triton kernels) and closely without
it, and a Flow-GRPO step and a weight push run on the GPU. Needs a CUDA GPU with Triton and
diffusers: skipped elsewhere (CPU CI). The lead runs it with scripts/gpu.sh (PARTS=diffusion)."""

from __future__ import annotations

import pytest
import torch

from diffusion_util import diffusion_config, rollout, train_config, write_dit
from noria.config import EngineConfig
from noria.models import exact_cuda

pytestmark = pytest.mark.skipif(not exact_cuda.available(), reason="needs a CUDA GPU with Triton")


@pytest.fixture(scope="module")
def dit(tmp_path_factory):
    return write_dit(tmp_path_factory.mktemp("dit") / "model")


def engine_for(path, deterministic):
    from noria.diffusion.engine import DiffusionEngine

    return DiffusionEngine.from_path(path, EngineConfig(deterministic=deterministic), dtype="bfloat16", device="cuda")


def trainer_for(path, dcfg, deterministic):
    from noria.diffusion.trainer import DiffusionTrainer

    trainer = DiffusionTrainer(train_config(device="cuda", param_dtype="bfloat16", **{"optim.lr": 1e-4}), dcfg,
                               deterministic=deterministic)  # fmt: skip
    trainer.init(path)
    return trainer


def test_engine_runs_on_the_gpu_in_bf16_and_is_batch_invariant(dit):
    dcfg = diffusion_config(steps=4)
    engine = engine_for(dit, deterministic=True)
    try:
        assert next(engine.model.parameters()).device.type == "cuda" and engine.model.dtype == torch.bfloat16
        alone = rollout(engine, dcfg, [3])
        crowd = rollout(engine, dcfg, [3, 0, 5, 7, 9, 1, 2, 4])  # sample 0 is the same request, batched with 7 more
    finally:
        engine.shutdown()
    assert torch.equal(alone[0].latents, crowd[0].latents)
    assert alone[0].latents.device.type == "cpu" and torch.isfinite(alone[0].latents).all()
    assert crowd[0].image.shape == (8, 8, 1)


@pytest.mark.parametrize("deterministic", [True, False])
def test_trainer_on_the_gpu_recomputes_the_engine_logprobs(dit, deterministic):
    dcfg = diffusion_config(steps=5)
    trainer = trainer_for(dit, dcfg, deterministic)
    engine = engine_for(dit, deterministic)
    try:
        samples = rollout(engine, dcfg, list(range(10)))
        recomputed = trainer.transition_logprobs(samples)
        engine_lp = torch.tensor([s.rollout_logprobs for s in samples])
        if deterministic:
            assert torch.equal(recomputed, engine_lp)
        else:
            assert (recomputed - engine_lp).abs().max() < 0.05
        metrics = trainer.rl_steps(samples, [1.0, -1.0] * 5, k=2)
        assert all(m["skipped"] == 0.0 for m in metrics) and trainer.optimizer_steps == 2
        buckets = [t for b in trainer.state_dict_for_sync(1 << 24) for t in b]
        assert all(t.device.type == "cuda" and t.dtype == torch.bfloat16 for _, t in buckets)
        engine.weights.update_from_state_dict(buckets, version=1)
        after = rollout(engine, dcfg, [0])
    finally:
        engine.shutdown()
    assert after[0].weight_versions == [1] * 5
    if deterministic:  # the pushed bf16 weights are the trainer's compute weights: still exact
        assert torch.equal(trainer.transition_logprobs(after), torch.tensor([after[0].rollout_logprobs]))


def test_flow_matching_sft_step_on_the_gpu(dit):
    trainer = trainer_for(dit, diffusion_config(steps=4), deterministic=False)
    x = torch.rand(16, 1, 8, 8) * 2 - 1
    out = trainer.sft_step(x, torch.arange(16) % 10)
    assert out["skipped"] == 0.0 and out["loss"] > 0 and next(trainer.model.parameters()).device.type == "cuda"
