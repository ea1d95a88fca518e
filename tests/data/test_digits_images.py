"""The ``digits_sum`` image task: deterministic by seed, labels are the sums of the digits drawn, the
held-out split is made of digit pictures no training image uses, and its prompts are JSON records
whose images are in the store (CPU, fast)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from noria.data import generate_split, get_task
from noria.data.digits_images import QUESTION, digit_composite, digit_pool
from noria.data.images import default_store
from noria.data.vision_chat import prompt_images
from noria.rewards import get_reward

SMALL = {"n_train": 120, "n_test": 40}


def test_deterministic_by_seed():
    first = generate_split("digits_sum", "train", {**SMALL, "seed": 3})
    assert first == generate_split("digits_sum", "train", {**SMALL, "seed": 3})
    assert first != generate_split("digits_sum", "train", {**SMALL, "seed": 4})
    assert generate_split("digits_sum", "test", {"n_test": 10}) == generate_split("digits_sum", "test", SMALL)[:10]


def test_prompts_are_an_image_and_the_question_with_the_sum_as_label():
    reward = get_reward(get_task("digits_sum").default_reward)
    for p in generate_split("digits_sum", "train", SMALL):
        ((message,),) = [p.prompt]
        assert message["role"] == "user" and message["content"][1] == {"type": "text", "text": QUESTION}
        assert 1 <= len(p.metadata["digits"]) <= 4 and p.label == str(sum(p.metadata["digits"]))
        assert reward(f"so the sum is {p.label}.", p.label, p.metadata) == 1.0
        image = default_store().get(prompt_images(p)[0])
        assert (image.mode, image.size) == ("L", (128, 32))
    json.dumps([p.prompt for p in generate_split("digits_sum", "test", SMALL)])


def test_the_image_shows_the_digits_in_their_slots():
    pictures, labels = digit_pool("train")
    image = np.asarray(digit_composite([pictures[0], pictures[1]], [1, 3], max_digits=4, scale=4))
    slots = [image[:, 32 * s : 32 * (s + 1)] for s in range(4)]
    assert slots[0].min() == slots[2].min() == 255  # blank slots stay white
    assert slots[1].min() < 128 and slots[3].min() < 128  # ink where the digits are
    assert int(labels[0]) in range(10)


def tiles(pool) -> set[bytes]:
    return {np.asarray(digit_composite([picture], [0], max_digits=1, scale=4)).tobytes() for picture in pool}


def test_held_out_images_use_unseen_digit_pictures():
    train_pool, test_pool = digit_pool("train")[0], digit_pool("test")[0]
    assert len(train_pool) + len(test_pool) == 1797 and len(test_pool) == 297
    train_tiles, test_tiles = tiles(train_pool), tiles(test_pool)
    train = generate_split("digits_sum", "train", SMALL)
    test = generate_split("digits_sum", "test", SMALL)
    for prompts, own in ((train, train_tiles), (test, test_tiles - train_tiles)):
        for p in prompts[:20]:
            image = np.asarray(default_store().get(prompt_images(p)[0]))
            used = [image[:, 32 * s : 32 * (s + 1)].tobytes() for s in range(4) if image[:, 32 * s : 32 * (s + 1)].min() < 255]
            assert len(used) == len(p.metadata["digits"]) and all(t in own for t in used)
    train_refs = {r for p in train for r in prompt_images(p)}
    test_refs = {r for p in test for r in prompt_images(p)}
    assert len(train_refs) == 120 and len(test_refs) == 40 and not train_refs & test_refs


def test_bad_arguments_name_the_key():
    with pytest.raises(ValueError, match=r"max_digits"):
        generate_split("digits_sum", "train", {"min_digits": 3, "max_digits": 2})
    with pytest.raises(ValueError, match=r"unknown argument\(s\) digits"):
        generate_split("digits_sum", "train", {"digits": 3})
