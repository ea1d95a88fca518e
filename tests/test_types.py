"""Typed records: versions and staleness inputs come from the data, never assumed."""

import dataclasses

import pytest

from noria.types import Group, Prompt, Sample, Status


def test_sample_min_version_ignores_non_policy_tokens():
    s = Sample(prompt_ids=[1, 2], response_ids=[5, 6, 7, 8], loss_mask=[1, 0, 1, 1],
               rollout_logprobs=[-0.1, 0.0, -0.2, -0.3], weight_versions=[3, -1, 4, 5])
    assert s.min_version == 3 and s.n_policy_tokens == 3
    assert Sample(prompt_ids=[1]).min_version is None and Sample(prompt_ids=[1]).status is Status.PENDING


def test_group_min_version_spans_samples():
    a = Sample(prompt_ids=[1], response_ids=[2], loss_mask=[1], weight_versions=[7], reward=1.0)
    b = Sample(prompt_ids=[1], response_ids=[2, 3], loss_mask=[1, 1], weight_versions=[5, 6], reward=0.0)
    g = Group(group_id=0, prompt=Prompt(prompt="p"), samples=(a, b))
    assert g.min_version == 5 and g.rewards == [1.0, 0.0]


def test_prompt_and_group_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Prompt(prompt="p").label = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        Group(group_id=0, prompt=Prompt(prompt="p"), samples=()).group_id = 1


def test_every_field_is_documented():
    import inspect

    import noria.types as types

    source = inspect.getsource(types)
    for cls in (Prompt, Sample, Group, types.TrainBatch):
        for f in dataclasses.fields(cls):
            # each field line is followed by its docstring
            line = next(line for line in source.splitlines() if line.strip().startswith(f"{f.name}:"))
            after = source.split(line, 1)[1].lstrip()
            assert after.startswith('"""'), f"{cls.__name__}.{f.name} has no docstring"
