"""Records with images: a sample's image references and a prompt's image parts survive the buffer's
JSON, and records written before images existed still load (CPU, fast)."""

from __future__ import annotations

import json

from noria.data import generate_split
from noria.data.vision_chat import prompt_images
from noria.rollout.buffer import group_from_dict, group_to_dict
from noria.types import Group, Sample, Status


def test_image_references_round_trip_through_buffer_json():
    prompt = generate_split("digits_sum", "test", {"n_test": 1})[0]
    refs = prompt_images(prompt)
    sample = Sample(prompt_ids=[1, 2], response_ids=[3], loss_mask=[1], rollout_logprobs=[-0.5], weight_versions=[0],
                    status=Status.COMPLETED, images=refs)  # fmt: skip
    data = json.loads(json.dumps(group_to_dict(Group(7, prompt, (sample,)))))
    back = group_from_dict(data)
    assert back.samples[0].images == refs and prompt_images(back.prompt) == refs
    assert back.prompt == prompt


def test_records_without_images_still_load():
    old = Sample(prompt_ids=[1], response_ids=[2], loss_mask=[1], rollout_logprobs=[-1.0], weight_versions=[0], status=Status.COMPLETED)
    data = json.loads(json.dumps(group_to_dict(Group(1, generate_split("arithmetic", "test", {"n_test": 1})[0], (old,)))))
    for row in data["samples"]:
        del row["images"]  # as written before the field existed
    assert group_from_dict(data).samples[0].images is None
