"""Held-out evaluation of an image policy, and image grids.

``evaluate_images`` samples ``eval.n_samples`` images of every test condition with the ODE
(``diffusion.eval_steps``, noise level 0) on salted seeds that training never draws
(``noria.diffusion.rollout.image_seed``), through the rollout engine's client, then scores them
twice: with ``diffusion.eval_reward`` (its mean is ``accuracy``; a failed score counts as 0, as in
text evaluation) and with the run's reward (``reward_mean``). ``diversity`` measures how different
the images of one condition are (``image_diversity``): RL that hacks its reward tends to collapse
every seed of a condition onto one image, which the scores alone do not show. The images are also
written as one PNG grid, a row per condition (``save_grid``), which ``noria report`` shows.

Not guaranteed: a grid of other than 8-bit grayscale or RGB images.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np

from noria.types import Sample

GRID_SCALE = 4
"""Each image pixel is this many PNG pixels (8x8 digits are too small to see otherwise)."""


async def evaluate_images(client: Any, config: Any, prompts: list, grid: Path | None = None) -> tuple[dict[str, Any], list[Sample]]:
    """(the eval.jsonl row's measurements, the samples), see the module docstring."""
    from noria.diffusion.rollout import generate_fn
    from noria.eval.runner import accuracy, check_scored
    from noria.rewards.runner import score_async
    from noria.rollout import RolloutContext
    from noria.rollout.generate import rollout_groups

    d, start = config.diffusion, time.perf_counter()
    ctx = RolloutContext(client, None, config.rollout, seed=config.eval.seed)
    gen = generate_fn(d.eval_steps, 0.0, d.shift, evaluation=True)
    result = await rollout_groups(ctx, prompts, 0, config.eval.n_samples, config.reward, gen)
    samples = [s for g in result.groups for s in g.samples]
    reward_mean = _mean([s.reward for s in samples if s.reward is not None])
    if d.eval_reward:
        judge = dataclasses.replace(config.reward, name=d.eval_reward, kwargs=dict(d.eval_reward_kwargs))
        for s in samples:
            s.reward = None
        await score_async(samples, judge, [g.prompt.label for g in result.groups for _ in g.samples])
    check_scored(samples, "image evaluation")
    rows = [[s.image for s in g.samples] for g in result.groups]
    if grid is not None:
        save_grid(rows, grid)
    row = {
        "accuracy": accuracy(samples), "reward_mean": reward_mean, "diversity": image_diversity(rows),
        "n_prompts": len(result.groups),
        "n_answers": len(samples), "failed": sum(s.reward is None for s in samples), "truncated": 0,
        "seconds": time.perf_counter() - start,
    }  # fmt: skip
    return row, samples


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def image_diversity(rows: list[list[Any]]) -> float:
    """Mean over conditions of the mean RMS pixel distance (pixels / 255, so in [0, 1]) between two
    images of the condition; rows with fewer than two images are left out (NaN if none is left)."""
    per_row = []
    for row in rows:
        images = [np.asarray(im, dtype=np.float64).reshape(-1) / 255.0 for im in row if im is not None]
        if len(images) < 2:
            continue
        x = np.stack(images)
        sq = (x * x).sum(1)
        dist = np.sqrt(np.maximum(sq[:, None] + sq[None, :] - 2 * x @ x.T, 0.0) / x.shape[1])
        n = len(images)
        per_row.append(dist.sum() / (n * (n - 1)))
    return float(np.mean(per_row)) if per_row else float("nan")


def save_grid(rows: list[list[Any]], path: Path, scale: int = GRID_SCALE) -> Path:
    """One PNG of uint8 images [H, W, C], a row per list (missing images black), nearest-upscaled."""
    from PIL import Image

    shaped = [im for row in rows for im in row if im is not None]
    if not shaped:
        raise ValueError("no image to put in a grid")
    h, w, c = shaped[0].shape
    cols = max(len(r) for r in rows)
    canvas = np.zeros((len(rows) * (h + 1), cols * (w + 1), c), dtype=np.uint8)
    for i, row in enumerate(rows):
        for j, im in enumerate(row):
            if im is not None:
                canvas[i * (h + 1) : i * (h + 1) + h, j * (w + 1) : j * (w + 1) + w] = im
    canvas = canvas.repeat(scale, 0).repeat(scale, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(canvas[..., 0] if c == 1 else canvas).save(path)
    return path
