"""The diffusion engine and trainer agree: seeds reproduce images bit for bit, the per-step
log-probabilities are Gaussian transition densities, and the trainer recomputes them exactly in
deterministic mode (fp32 and bf16 where the CPU runs it; under NORIA_CPU_ISA=avx2 auto is fp32)."""

from __future__ import annotations

import math

import pytest
import torch

from diffusion_util import diffusion_config, rollout, train_config, write_dit
from noria.config import EngineConfig


@pytest.fixture(scope="module")
def dit(tmp_path_factory):
    return write_dit(tmp_path_factory.mktemp("dit") / "model")


def engine_for(path, deterministic=True, dtype="auto", lora=None):
    from noria.diffusion.engine import DiffusionEngine

    return DiffusionEngine.from_path(path, EngineConfig(deterministic=deterministic), dtype=dtype, lora=lora)


def test_same_seed_same_image_bit_for_bit_whatever_the_batch(dit):
    from noria.diffusion.protocol import ImageRequest

    engine = engine_for(dit)
    try:
        alone = engine.generate_batch([ImageRequest(label=3, seed=7, steps=6)])[0]
        crowd = engine.generate_batch([ImageRequest(label=c, seed=100 + c, steps=6) for c in range(5)]
                                      + [ImageRequest(label=3, seed=7, steps=6)])[-1]
        other = engine.generate_batch([ImageRequest(label=3, seed=8, steps=6)])[0]
    finally:
        engine.shutdown()
    assert torch.equal(alone.latents, crowd.latents)
    assert alone.logprobs == crowd.logprobs
    assert not torch.equal(alone.latents, other.latents)  # the seed does matter
    assert alone.weight_versions == [0] * 6


def test_step_logprobs_are_the_gaussian_transition_density(dit):
    """Reference: the mean and std written out again in float64 from the paper's formulas, and
    torch.distributions.Normal's density, averaged over dimensions."""
    from noria.diffusion.model import load_dit, velocity
    from noria.diffusion.protocol import ImageRequest
    from noria.diffusion.sde import flow_sigmas

    engine = engine_for(dit, deterministic=False, dtype="float32")
    out = engine.generate_batch([ImageRequest(label=5, seed=3, steps=5, noise_level=0.8, shift=2.0)])[0]
    engine.shutdown()
    model, sig, a = load_dit(dit), flow_sigmas(5, 2.0).double(), 0.8
    for j in range(5):
        x, x_next = out.latents[j : j + 1].double(), out.latents[j + 1 : j + 2].double()
        with torch.no_grad():
            v = velocity(model, x.float(), sig[j : j + 1].float(), torch.tensor([5])).double()
        s, dt = sig[j], sig[j + 1] - sig[j]
        std_s = a * math.sqrt(s / (1 - (sig[1] if s == 1 else s)))
        mean = x * (1 + std_s**2 / (2 * s) * dt) + v * (1 + std_s**2 * (1 - s) / (2 * s)) * dt
        ref = torch.distributions.Normal(mean, std_s * math.sqrt(-dt)).log_prob(x_next).mean()
        assert out.logprobs[j] == pytest.approx(float(ref), abs=2e-4, rel=1e-4)


def test_ode_step_is_diffusers_flow_match_euler_step(dit):
    from diffusers import FlowMatchEulerDiscreteScheduler

    from noria.diffusion.model import load_dit, velocity
    from noria.diffusion.protocol import ImageRequest

    engine = engine_for(dit, deterministic=False, dtype="float32")
    out = engine.generate_batch([ImageRequest(label=1, seed=11, steps=4, noise_level=0.0, shift=3.0)])[0]
    engine.shutdown()
    assert out.logprobs == [0.0] * 4
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(4)
    model, x = load_dit(dit), out.latents[:1]
    for t in scheduler.timesteps:
        with torch.no_grad():
            v = velocity(model, x, (t / 1000).expand(1), torch.tensor([1]))
        x = scheduler.step(v, t, x).prev_sample
    torch.testing.assert_close(x, out.latents[-1:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lora", [False, True])
def test_trainer_recomputes_engine_logprobs_exactly_in_deterministic_mode(dit, lora):
    from noria.diffusion.trainer import DiffusionTrainer

    dcfg = diffusion_config(steps=5, noise_level=0.7)
    changes = {"lora.enabled": True, "lora.sync": "adapter", "lora.target_modules": ["to_q", "to_v", "ff.net.2"]} if lora else {}
    cfg = train_config(**changes)
    trainer = DiffusionTrainer(cfg, dcfg, deterministic=True)
    trainer.init(dit)
    engine = engine_for(dit, lora=cfg.lora if lora else None)
    try:
        if lora:  # adapters that are not zero, pushed as adapters only
            with torch.no_grad():
                for name, p in trainer.model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.05)
            engine.weights.update_from_state_dict([t for b in trainer.state_dict_for_sync(1 << 20) for t in b], version=1)
        samples = rollout(engine, dcfg, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 3, 3])
    finally:
        engine.shutdown()
    engine_lp = torch.tensor([s.rollout_logprobs for s in samples])
    assert torch.equal(trainer.transition_logprobs(samples), engine_lp)
    assert {v for s in samples for v in s.weight_versions} == {1 if lora else 0}


def test_trainer_recomputes_engine_logprobs_closely_without_deterministic_mode(dit):
    from noria.diffusion.trainer import DiffusionTrainer

    dcfg = diffusion_config(steps=4)
    trainer = DiffusionTrainer(train_config(param_dtype="float32"), dcfg)
    trainer.init(dit)
    engine = engine_for(dit, deterministic=False, dtype="float32")
    samples = rollout(engine, dcfg, list(range(10)))
    engine.shutdown()
    engine_lp = torch.tensor([s.rollout_logprobs for s in samples])
    torch.testing.assert_close(trainer.transition_logprobs(samples), engine_lp, atol=1e-3, rtol=1e-4)


def test_weight_update_between_steps_changes_the_version_of_later_steps(dit):
    import time

    from noria.diffusion.protocol import ImageRequest
    from noria.diffusion.trainer import DiffusionTrainer

    trainer = DiffusionTrainer(train_config(), diffusion_config())
    trainer.init(dit)
    engine = engine_for(dit)
    box: list = []
    try:
        engine.submit(ImageRequest(label=2, seed=1, steps=400), box.append)
        while engine.metrics()["image_steps"] < 2:
            time.sleep(0.001)
        engine.weights.update_from_state_dict([t for b in trainer.state_dict_for_sync(1 << 20) for t in b], version=5)
        while not box:
            time.sleep(0.001)
    finally:
        engine.shutdown()
    versions = box[0].weight_versions
    assert versions[0] == 0 and versions[-1] == 5 and versions == sorted(versions)


def test_bad_requests_are_refused_naming_the_field(dit):
    from noria.diffusion.protocol import ImageRequest
    from noria.engine.protocol import RequestError

    engine = engine_for(dit)
    try:
        with pytest.raises(RequestError, match="label"):
            engine.submit(ImageRequest(label=10, seed=0), lambda out: None)
        with pytest.raises(RequestError, match="steps"):
            engine.submit(ImageRequest(label=1, seed=0, steps=0), lambda out: None)
        with pytest.raises(RequestError, match="unknown field"):
            ImageRequest.from_dict({"label": 1, "seed": 0, "stepz": 3})
    finally:
        engine.shutdown()


def test_a_batch_submitted_together_runs_in_its_step_count_and_mixes_ode_with_sde(dit):
    """generate_batch admits every request at the same step: a full batch of T-step images costs T
    steps, not T plus the steps a straggler joins late. ODE images share the batch with SDE ones
    and are the images they are alone (they draw no step noise; their log-probabilities are 0)."""
    from noria.diffusion.protocol import ImageRequest

    engine = engine_for(dit)
    try:
        requests = [ImageRequest(label=c, seed=c, steps=5, noise_level=0.0 if c % 3 == 0 else 0.7) for c in range(10)]
        before = engine.metrics()["steps"]
        crowd = engine.generate_batch(requests)
        assert engine.metrics()["steps"] - before == 5
        alone = [engine.generate_batch([r])[0] for r in requests]
    finally:
        engine.shutdown()
    for req, a, b in zip(requests, alone, crowd):
        assert torch.equal(a.latents, b.latents) and a.logprobs == b.logprobs
        assert (a.logprobs == [0.0] * 5) == (req.noise_level == 0.0)


def test_noise_drawn_ahead_is_the_noise_drawn_step_by_step(dit, monkeypatch):
    """A CPU batch draws each SDE image's noise for all its steps at once (``_draw_ahead``); an image
    that leaves such a batch early (others joined) takes the rest along. Its images are bit for bit
    those of one draw per step, whether no batch draws ahead or some do (a cap of 1000 values: the first
    batch, 3 x 5 steps x 64 values, draws ahead and ends early; the larger one after the arrivals draws
    per step unless the first batch had only two steps left, taking the first images' unused noise)."""
    import asyncio

    import noria.diffusion.engine as engine_module
    from noria.diffusion.protocol import ImageRequest

    first = [ImageRequest(label=c, seed=40 + c, steps=5, noise_level=0.7) for c in range(3)]
    later = [ImageRequest(label=c, seed=50 + c, steps=4, noise_level=0.0 if c == 0 else 1.0) for c in range(3)]

    async def arrivals(engine) -> list:
        started = [asyncio.ensure_future(engine.generate(r)) for r in first]
        while engine.metrics()["steps"] < 2:  # the first batch is under way: the others join it mid-way
            await asyncio.sleep(0.005)
        return await asyncio.gather(*started, *[engine.generate(r) for r in later])

    def images(cap: int) -> list:
        monkeypatch.setattr(engine_module, "AHEAD_MAX_ELEMENTS", cap)
        engine = engine_for(dit)
        try:
            return [(o.latents, o.logprobs) for o in asyncio.run(arrivals(engine))]
        finally:
            engine.shutdown()

    for (a, la), (b, lb) in zip(images(0), images(1000)):
        assert torch.equal(a, b) and la == lb


def test_generate_batch_times_out_as_a_whole_naming_what_is_left(dit):
    """One deadline for the batch (not one per request, which let a batch of n wait n times as long),
    and the engine goes on serving once resumed."""
    import asyncio

    from noria.diffusion.protocol import ImageRequest

    engine = engine_for(dit)
    try:
        asyncio.run(engine.pause())
        with pytest.raises(TimeoutError, match="3 of 3 requests were not done after 0.2 s"):
            engine.generate_batch([ImageRequest(label=c, seed=c, steps=2) for c in range(3)], timeout_s=0.2)
        asyncio.run(engine.resume())
        out = engine.generate_batch([ImageRequest(label=1, seed=1, steps=2)], timeout_s=60)
    finally:
        engine.shutdown()
    assert out[0].finished_ok and len(out[0].latents) == 3
