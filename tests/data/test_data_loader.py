"""PromptSource: seeded per-epoch shuffles, resumable cursor, returned prompts (CPU, fast)."""

from __future__ import annotations

import json

import pytest

from noria.config import DataConfig
from noria.data import PromptSource
from noria.types import Prompt

PROMPTS = [Prompt(f"q{i}", label=str(i), metadata={"i": i}, index=i, source="mem") for i in range(7)]


def drain(source: PromptSource, batch: int) -> list[str]:
    out = []
    while not source.exhausted:
        out += [p.prompt for p in source.next_batch(batch)]
    return out


def test_each_epoch_is_a_fresh_seeded_permutation():
    order = drain(PromptSource(PROMPTS, seed=1, epochs=3), batch=3)
    assert len(order) == 21
    epochs = [order[i * 7:(i + 1) * 7] for i in range(3)]
    assert all(sorted(e) == sorted(p.prompt for p in PROMPTS) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3
    assert order == drain(PromptSource(PROMPTS, seed=1, epochs=3), batch=5)
    assert order != drain(PromptSource(PROMPTS, seed=2, epochs=3), batch=3)


def test_no_shuffle_keeps_file_order():
    assert drain(PromptSource(PROMPTS, shuffle=False, epochs=2), 4) == [f"q{i}" for i in range(7)] * 2


def test_last_batch_is_short_then_empty():
    source = PromptSource(PROMPTS, epochs=1)
    assert [len(source.next_batch(3)) for _ in range(4)] == [3, 3, 1, 0]
    assert source.exhausted and source.epoch == 1


def test_restore_continues_identically_across_an_epoch_boundary():
    original = PromptSource(PROMPTS, seed=5, epochs=3)
    original.next_batch(5)
    state = json.loads(json.dumps(original.state_dict()))  # what a checkpoint stores
    expected = drain(original, batch=4)
    restored = PromptSource.from_config(PROMPTS, DataConfig(task="arithmetic", seed=5, epochs=3))
    restored.load_state_dict(state)
    assert drain(restored, batch=4) == expected
    assert len(expected) == 16  # crossed from epoch 0 through epoch 2


def test_returned_prompts_come_first_and_survive_restore():
    source = PromptSource(PROMPTS, seed=0, epochs=1)
    first = source.next_batch(3)
    source.return_prompt(first[1])
    source.return_prompt(first[0])
    state = json.loads(json.dumps(source.state_dict()))
    expected = source.next_batch(4)
    assert expected[:2] == [first[1], first[0]]
    restored = PromptSource(PROMPTS, seed=0, epochs=1)
    restored.load_state_dict(state)
    assert restored.next_batch(4) == expected


def test_returned_prompts_are_served_after_the_last_epoch():
    source = PromptSource(PROMPTS, epochs=1)
    batch = source.next_batch(7)
    assert source.exhausted
    source.return_prompt(batch[3])
    assert not source.exhausted and source.next_batch(2) == [batch[3]]


def test_restore_refuses_a_different_source():
    state = PromptSource(PROMPTS, seed=0).state_dict()
    with pytest.raises(ValueError, match="n_prompts"):
        PromptSource(PROMPTS[:5], seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PromptSource(PROMPTS, seed=9).load_state_dict(state)
