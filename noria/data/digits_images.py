"""The ``digits_sum`` task: pictures of 1-4 handwritten digits side by side, and the sum they make.

Each problem is one image and one question. The image is a white canvas of ``max_digits`` slots in a
row, each slot ``8 * scale`` pixels square; ``n`` of them (1 to ``max_digits``) hold a digit from
scikit-learn's ``load_digits`` (8x8 greyscale, upsampled bilinearly, dark ink on white), the others
stay blank. The question is :data:`QUESTION`; the label is the sum, as a string (the ``numeric``
reward's form); metadata holds the digits left to right (``digits``).

Held-out images are unseen ones: the 1,797 digit pictures are cut once, by a fixed permutation,
into a test pool (``n_test_digits`` pictures, default 297) and a train pool, and each split's
composites are made only of its own pool's pictures, so no test image shares a digit picture with
any training image. Within a split, composites are distinct images (by content hash); the same
arguments always give the same images in the same order (numpy's seeded generator, Pillow's
bilinear resize).

Prompts are chat messages whose user turn holds an image part referring to the image by content
hash (``noria.data.images``; the images are put in the process's image store) and the question.
``digit_composite`` and ``digit_pool`` are what the VLM builder (``noria.models.vlm_build``) trains
its warm start on, from the train pool only.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from noria.types import Prompt

QUESTION = "What is the sum of the digits in the image?"
DEFAULTS: dict[str, Any] = {"n_train": 2000, "n_test": 200, "seed": 0, "min_digits": 1, "max_digits": 4, "scale": 4, "n_test_digits": 297}
"""Every argument of ``data.task: digits_sum`` with its default."""
POOL_SEED = 0
DIGITS_TOTAL = 1797
"""Pictures in scikit-learn's ``load_digits``."""
MAX_DRAWS_PER_PROMPT = 50


def check_args(args: dict[str, Any]) -> None:
    """``ValueError`` naming the first unusable argument."""
    for key in ("seed", "min_digits", "max_digits", "scale", "n_test_digits"):
        if not isinstance(args[key], int) or args[key] < (0 if key == "seed" else 1):
            raise ValueError(f"task 'digits_sum': {key} must be an integer >= {0 if key == 'seed' else 1}, got {args[key]!r}")
    if not args["min_digits"] <= args["max_digits"] <= 8:
        raise ValueError(f"task 'digits_sum': need 1 <= min_digits <= max_digits <= 8, got {args['min_digits']}, {args['max_digits']}")
    if not args["n_test_digits"] < DIGITS_TOTAL - 10:
        raise ValueError(f"task 'digits_sum': n_test_digits must leave training pictures, got {args['n_test_digits']}")


@functools.lru_cache(maxsize=4)
def digit_pool(split: str, n_test_digits: int = DEFAULTS["n_test_digits"]) -> tuple[np.ndarray, np.ndarray]:
    """(pictures float [N, 8, 8] in 0..16, labels int [N]) of the ``train`` or ``test`` pool."""
    from sklearn.datasets import load_digits

    if split not in ("train", "test"):
        raise ValueError(f"split must be train or test, got {split!r}")
    data = load_digits()
    order = np.random.default_rng(POOL_SEED).permutation(len(data.target))
    idx = order[:n_test_digits] if split == "test" else order[n_test_digits:]
    return data.images[idx], data.target[idx].astype(np.int64)


def digit_composite(pictures: list[np.ndarray], slots: list[int], max_digits: int, scale: int):
    """A greyscale Pillow image of ``max_digits`` slots with ``pictures[i]`` in slot ``slots[i]``."""
    from PIL import Image

    side = 8 * scale
    canvas = Image.new("L", (side * max_digits, side), 255)
    for picture, slot in zip(pictures, slots):
        ink = np.clip(255.0 - picture * (255.0 / 16.0), 0, 255).round().astype(np.uint8)
        tile = Image.fromarray(ink, mode="L").resize((side, side), Image.BILINEAR)
        canvas.paste(tile, (slot * side, 0))
    return canvas


def draw_composite(rng: np.random.Generator, pool: tuple[np.ndarray, np.ndarray], args: dict[str, Any]):
    """One random composite from ``pool``: (image, digits left to right, their slots)."""
    pictures, labels = pool
    n = int(rng.integers(args["min_digits"], args["max_digits"] + 1))
    slots = sorted(int(s) for s in rng.choice(args["max_digits"], size=n, replace=False))
    picks = [int(i) for i in rng.integers(len(labels), size=n)]
    image = digit_composite([pictures[i] for i in picks], slots, args["max_digits"], args["scale"])
    return image, [int(labels[i]) for i in picks], slots


def image_message(ref: str, text: str) -> dict[str, Any]:
    """A user message holding one image (by reference) then ``text``."""
    return {"role": "user", "content": [{"type": "image", "image": ref}, {"type": "text", "text": text}]}


def generate(split: str, args: dict[str, Any]) -> list[Prompt]:
    """The ``split`` prompts (``n_train`` or ``n_test`` of them), deterministic given ``args``."""
    from noria.data.images import default_store

    store = default_store()
    pool = digit_pool(split, args["n_test_digits"])
    rng = np.random.default_rng([args["seed"], 0 if split == "train" else 1])
    count, seen, prompts = args[f"n_{split}"], set(), []
    for _ in range(max(1, count) * MAX_DRAWS_PER_PROMPT):
        if len(prompts) == count:
            break
        image, digits, _ = draw_composite(rng, pool, args)
        ref = store.put(image)
        if ref in seen:
            continue
        seen.add(ref)
        metadata = {"task": "digits_sum", "digits": digits}
        prompts.append(Prompt((image_message(ref, QUESTION),), str(sum(digits)), metadata, len(prompts), f"task:digits_sum/{split}"))
    if len(prompts) < count:
        raise ValueError(f"task 'digits_sum': found only {len(prompts)} distinct {split} images of the {count} asked")
    return prompts
