"""Image rollout: the generate function that turns a condition ``Sample`` into an image trajectory.

The RL loop's rollout scheduler (``noria.rollout.scheduler``) runs it like the text one
(``generate_one``): per sample, through the engine client (``LocalEngineClient`` around a
``DiffusionEngine`` in process, ``DiffusionHttpClient`` over HTTP). What a trajectory looks like
as a ``Sample`` (``noria.types``): ``prompt_ids`` = [class label]; one "token" per denoising step:
``response_ids`` = the step indices 0..T-1, ``loss_mask`` 1, ``rollout_logprobs`` = the engine's
transition log-probabilities, ``weight_versions`` = the version of each step; ``latents`` =
[T+1, C, H, W] (float32, CPU), ``image`` = the uint8 image rewards score; ``metadata["diffusion"]``
= the sampler settings the trainer checks against its own.

Seeds: an image's seed is a pure function of (run seed, group id, sample index) as for text
(``noria.rollout.sample_seed``); evaluation images use the same function on a salted seed, so
held-out evaluation never draws a noise sequence training drew.
"""

from __future__ import annotations

import functools
from typing import Any

from noria.diffusion.model import to_image
from noria.diffusion.protocol import ImageRequest
from noria.rollout.generate import sample_seed
from noria.types import Sample, Status

EVAL_SALT = 0x5EED_E7A1
"""XOR-ed into the seed of evaluation images (a seed space training never uses)."""


def image_seed(seed: int, group_id: int, index: int, evaluation: bool = False) -> int:
    """The noise seed of sample ``index`` of group ``group_id``."""
    return sample_seed(seed ^ EVAL_SALT if evaluation else seed, group_id, index)


def generate_fn(steps: int, noise_level: float, shift: float, evaluation: bool = False) -> Any:
    """A generate function ``async (ctx, sample) -> sample`` sampling with these settings."""
    return functools.partial(generate_image, steps=steps, noise_level=noise_level, shift=shift, evaluation=evaluation)


async def generate_image(ctx: Any, sample: Sample, *, steps: int, noise_level: float, shift: float, evaluation: bool = False) -> Sample:
    """One image trajectory from the engine, recorded into ``sample`` (see the module docstring)."""
    seed = image_seed(ctx.seed, sample.group_id, sample.index, evaluation)
    req = ImageRequest(label=int(sample.prompt_ids[0]), seed=seed, steps=steps, noise_level=noise_level, shift=shift)
    out = await ctx.engine.generate(req)
    sample.metadata["diffusion"] = {"steps": steps, "noise_level": noise_level, "shift": shift, "seed": seed}
    if not out.finished_ok:
        sample.status = Status.ABORTED
        sample.status_reason = str(out.finish_reason.get("message", "aborted by the engine"))
        return sample
    sample.response_ids = list(range(steps))
    sample.loss_mask = [1] * steps
    sample.rollout_logprobs = list(out.logprobs)
    sample.weight_versions = list(out.weight_versions)
    sample.latents = out.latents
    sample.image = to_image(out.latents[-1])
    h, w, c = sample.image.shape
    sample.response_text = f"<image {h}x{w}x{c}>"
    sample.status = Status.COMPLETED
    return sample
