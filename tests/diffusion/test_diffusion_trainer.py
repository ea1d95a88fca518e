"""The DiT trainer: flow-matching SFT learns, the RL objectives move the policy the right way, weights
reach the engine (full or adapters only) bit for bit, checkpoints resume exactly, exports load in
diffusers."""

from __future__ import annotations

import asyncio

import pytest
import torch

from diffusion_util import diffusion_config, train_config, write_dit
from noria.config import EngineConfig, SyncConfig

LORA = {"lora.enabled": True, "lora.sync": "adapter", "lora.target_modules": ["to_q", "to_k", "to_v", "to_out.0", "ff.net.2"]}


@pytest.fixture(scope="module")
def dit(tmp_path_factory):
    return write_dit(tmp_path_factory.mktemp("dit") / "model")


def trainer_for(path, dcfg=None, deterministic=True, total_steps=None, allow_new=False, **changes):
    from noria.diffusion.trainer import DiffusionTrainer

    trainer = DiffusionTrainer(train_config(**changes), dcfg or diffusion_config(steps=4), deterministic=deterministic)
    trainer.init(path, total_steps=total_steps, allow_new=allow_new)
    return trainer


def engine_for(path, lora=None):
    from noria.diffusion.engine import DiffusionEngine

    return DiffusionEngine.from_path(path, EngineConfig(deterministic=True), lora=lora)


def images(engine, dcfg, labels, seed=0):
    from noria.diffusion.rollout import generate_fn
    from noria.rollout import LocalEngineClient, RolloutContext
    from noria.types import Sample

    ctx = RolloutContext(LocalEngineClient(engine), None, None, seed=seed)
    gen = generate_fn(dcfg.steps, dcfg.noise_level, dcfg.shift)
    samples = [Sample(prompt_ids=[c], group_id=0, index=i) for i, c in enumerate(labels)]

    async def run():
        return await asyncio.gather(*(gen(ctx, s) for s in samples))

    return asyncio.run(run())


def test_flow_matching_sft_on_digits_lowers_the_loss(tmp_path):
    from noria.diffusion.data import digits_split
    from noria.diffusion.model import from_image

    folder = write_dit(tmp_path / "new", weights=False, num_layers=2, attention_head_dim=16)
    trainer = trainer_for(folder, allow_new=True, deterministic=False, algorithm="sft", **{"optim.lr": 2e-3})
    pixels, labels = digits_split("train")
    x, y = torch.stack([from_image(p) for p in pixels[:512]]), torch.tensor(labels[:512])
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(60):
        idx = torch.randint(0, len(x), (32,), generator=gen)
        losses.append(trainer.sft_step(x[idx], y[idx])["loss"])
    assert sum(losses[-10:]) / 10 < 0.75 * sum(losses[:10]) / 10, losses


@pytest.mark.parametrize("objective", ["flow_grpo", "diffusion_nft"])
def test_rl_step_raises_the_likelihood_of_better_images(dit, objective):
    """One image per class, classes 0-4 with a positive advantage and 5-9 with a negative one: after
    an update the positive ones' trajectories are more likely, the negative ones' less (per-step
    log-probs). DiffusionNFT has no likelihood in its loss: it moves the trajectories' log-probs
    only through its forward-process draws (32 per image here, from a fixed seed: the draws come
    from torch's global RNG, which the tests run before would otherwise set), so what it promises is
    the contrast: the positives gain on the negatives, and the negatives lose. Whether the
    positives' own mean moves up was the draws' and the CPU's: up on an AVX2 Zen 3 (fp32), -0.0006
    on an AVX-512 Zen 4 (bf16) against -0.0045 for the negatives."""
    dcfg = diffusion_config(steps=4, objective=objective, nft_timesteps=32)
    trainer = trainer_for(dit, dcfg, **{"optim.lr": 1e-4, "optim.grad_clip": None})
    engine = engine_for(dit)
    samples = images(engine, dcfg, list(range(10)))
    engine.shutdown()
    before = trainer.transition_logprobs(samples)
    advantages = [1.0 if s.prompt_ids[0] < 5 else -1.0 for s in samples]
    torch.manual_seed(0)
    metrics = trainer.rl_steps(samples, advantages, k=1)
    change = (trainer.transition_logprobs(samples) - before).sum(1)
    up, down = change[:5], change[5:]
    if objective == "flow_grpo":
        assert float(up.mean()) > 0 > float(down.mean()), change
    else:
        assert float(up.mean()) > float(down.mean()) and float(down.mean()) < 0, change
    assert metrics[0]["skipped"] == 0.0 and metrics[0]["step"] == 1.0
    if objective == "flow_grpo":  # the engine's and the trainer's log-probs agree exactly (deterministic)
        assert metrics[0]["rollout_logprob_abs_diff"] == 0.0 and metrics[0]["clip_frac"] == 0.0


def test_several_optimizer_steps_per_rollout_use_the_old_policy_of_the_step(dit):
    dcfg = diffusion_config(steps=4, train_steps=2)
    trainer = trainer_for(dit, dcfg, **{"optim.lr": 5e-3})
    engine = engine_for(dit)
    samples = images(engine, dcfg, list(range(8)))
    engine.shutdown()
    metrics = trainer.rl_steps(samples, [1.0, -1.0] * 4, k=2)
    assert [m["step"] for m in metrics] == [1.0, 2.0]
    assert metrics[0]["approx_kl"] == 0.0 < metrics[1]["approx_kl"]  # the second slice sees the first update
    assert metrics[0]["train/pairs"] == 4 * 2  # 4 images x train_steps 2


@pytest.mark.parametrize("lora", [False, True])
def test_weights_reach_the_engine_bit_for_bit(dit, lora):
    from noria.sync import build_sync

    trainer = trainer_for(dit, **(LORA if lora else {}))
    with torch.no_grad():
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.add_(0.01)
    engine = engine_for(dit, lora=trainer.cfg.lora if lora else None)
    sync = build_sync(SyncConfig(transport="ipc", verify=True), [engine])
    try:
        metrics = sync.push(trainer.state_dict_for_sync(1 << 20), version=3)
    finally:
        sync.close()
        engine.shutdown()
    assert engine.weight_version == 3
    full = sum(t.numel() * t.element_size() for _, t in trainer.named_weights(trainer.dtype))
    assert (metrics["sync/bytes"] < full / 4) if lora else (metrics["sync/bytes"] == full)


def test_checkpoint_resumes_bit_for_bit(dit, tmp_path):
    dcfg = diffusion_config(steps=4, train_steps=2)
    engine = engine_for(dit)
    samples = images(engine, dcfg, list(range(6)))
    engine.shutdown()
    adv = [1.0, -1.0, 0.5, -0.5, 2.0, -2.0]
    first = trainer_for(dit, dcfg, total_steps=4)
    first.rl_steps(samples, adv)
    first.save(tmp_path / "ckpt", extra={"at": 1})
    expected = first.rl_steps(samples, adv)[0]
    second = trainer_for(dit, dcfg, total_steps=4)
    assert second.load(tmp_path / "ckpt") == {"at": 1}
    got = second.rl_steps(samples, adv)[0]
    expected.pop("step_time_s"), got.pop("step_time_s")
    assert got == expected  # the same step subsets (RNG restored), losses, gradients, to the bit
    assert all(torch.equal(a, b) for a, b in zip(first.model.parameters(), second.model.parameters()))


def test_export_is_a_diffusers_folder_with_lora_merged(dit, tmp_path):
    from diffusers import DiTTransformer2DModel

    trainer = trainer_for(dit, **{**LORA, "lora.sync": "merged"}, deterministic=False)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    trainer.export_hf(tmp_path / "final")
    loaded = DiTTransformer2DModel.from_pretrained(tmp_path / "final")
    x, s, y = torch.randn(3, 1, 8, 8), torch.rand(3), torch.tensor([1, 2, 3])
    with torch.no_grad():
        want = trainer.predict(x, s, y)
        from noria.diffusion.model import velocity

        got = velocity(loaded.to(trainer.dtype), x, s, y)
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)  # merged weights round once in the compute dtype


def test_a_non_finite_step_is_skipped_up_to_the_limit_then_raises(dit):
    """The step guard of every trainer (noria.train.step_guard): a NaN loss applies nothing."""
    from noria.train.backend import NonFiniteError

    trainer = trainer_for(dit, deterministic=False, algorithm="sft", max_nonfinite_skips=1)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    x, y = torch.full((2, 1, 8, 8), float("nan")), torch.tensor([1, 2])  # latents of the tiny DiT
    assert trainer.sft_step(x, y)["skipped"] == 1.0 and trainer.nonfinite_streak == 1
    assert trainer.optimizer_steps == 0 and all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    with pytest.raises(NonFiniteError, match="step 1"):
        trainer.sft_step(x, y)


def test_the_objectives_registry_names_the_config_field_and_refuses_a_second_entry():
    from noria.diffusion.objectives import get_diffusion_objective, register_diffusion_objective
    from noria.train.algorithms import UnknownAlgorithmError

    assert get_diffusion_objective("flow_grpo").kind == "transition"
    assert get_diffusion_objective("diffusion_nft").kind == "forward"
    with pytest.raises(UnknownAlgorithmError, match=r"diffusion\.objective: .*valid: diffusion_nft, flow_grpo"):
        get_diffusion_objective("grpo")
    with pytest.raises(ValueError, match="already registered"):
        register_diffusion_objective("flow_grpo", "transition")(lambda *args: None)
