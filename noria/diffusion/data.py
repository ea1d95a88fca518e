"""Image data for the diffusion runs: the handwritten digits that ship inside scikit-learn.

``sklearn.datasets.load_digits``: 1,797 grayscale 8x8 images (values 0..16) of the digits 0-9,
read from scikit-learn's own package data (no download). ``digits_split`` takes the one cut of them (the
image task's, ``noria.data.digits_images.digit_pool``) into a train and a test split (``n_test`` images,
default 297), so the classifier behind the rewards and the DiT never see the test images in training.

Conditions (what a diffusion prompt is): one ``Prompt`` per class label, ``prompt`` = "digit 3",
``label`` = 3 (what the rewards compare against). ``condition_prompts`` repeats each class
``prompts_per_class`` times per epoch for RL, and gives each class once for evaluation; held-out
evaluation uses seeds the training never draws (``noria.diffusion.rollout.image_seed``), not other
classes.

Task arguments (``data.task_args``; unknown keys are refused): ``n_test``, ``prompts_per_class``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from noria.errors import NoriaError
from noria.types import Prompt

DIGITS_ARGS: dict[str, Any] = {"n_test": 297, "prompts_per_class": 8}
"""Every argument of ``data.task: digits`` with its default."""
NUM_CLASSES = 10


def digits_args(task_args: dict[str, Any]) -> dict[str, Any]:
    """The resolved task arguments; an unknown key or a bad value raises naming it."""
    unknown = sorted(set(task_args) - set(DIGITS_ARGS))
    if unknown:
        raise NoriaError(f"data.task_args: unknown argument(s) {', '.join(unknown)} for digits; valid: {', '.join(DIGITS_ARGS)}")
    args = {**DIGITS_ARGS, **task_args}
    for key in DIGITS_ARGS:
        if not isinstance(args[key], int) or args[key] < 1:
            raise NoriaError(f"data.task_args.{key} must be an integer >= 1, got {args[key]!r}")
    return args


@functools.lru_cache(maxsize=4)
def digits_split(split: str, n_test: int = DIGITS_ARGS["n_test"]) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [N, 8, 8, 1] scaled to 0..255, labels int64 [N]) of the ``train`` or ``test`` split:
    the pictures of ``noria.data.digits_images.digit_pool``, the one cut of the digits (the image
    task's held-out pictures are these too)."""
    from noria.data.digits_images import DIGITS_TOTAL, digit_pool

    if not 0 < n_test < DIGITS_TOTAL:
        raise NoriaError(f"data.task_args.n_test must be in [1, {DIGITS_TOTAL - 1}], got {n_test}")
    pictures, labels = digit_pool(split, n_test)
    return np.round(pictures * (255.0 / 16.0)).astype(np.uint8)[..., None], labels


def condition_prompts(split: str, task_args: dict[str, Any]) -> list[Prompt]:
    """Class-condition prompts: train = every class ``prompts_per_class`` times (class-major order;
    the source shuffles), test = every class once."""
    args = digits_args(task_args)
    repeats = args["prompts_per_class"] if split == "train" else 1
    labels = [c for c in range(NUM_CLASSES) for _ in range(repeats)]
    return [Prompt(f"digit {c}", c, {"class": c}, i, f"task:digits/{split}") for i, c in enumerate(labels)]
