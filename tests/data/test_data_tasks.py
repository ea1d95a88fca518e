"""Built-in synthetic tasks: determinism, disjoint splits, closed arguments (CPU, fast)."""

from __future__ import annotations

import pytest

from noria.data import TASKS, generate_split, get_task
from noria.rewards import get_reward

SMALL = {"n_train": 200, "n_test": 40}


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_deterministic_by_seed(name):
    first = generate_split(name, "train", {**SMALL, "seed": 3})
    assert first == generate_split(name, "train", {**SMALL, "seed": 3})
    assert first != generate_split(name, "train", {**SMALL, "seed": 4})


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_splits_are_disjoint_and_sized(name):
    train = generate_split(name, "train", SMALL)
    test = generate_split(name, "test", SMALL)
    assert (len(train), len(test)) == (200, 40)
    train_texts, test_texts = {p.prompt for p in train}, {p.prompt for p in test}
    assert len(train_texts) == 200 and len(test_texts) == 40
    assert not train_texts & test_texts
    assert {p.source for p in test} == {f"task:{name}/test"}
    assert [p.index for p in train] == list(range(200))


def test_test_split_does_not_depend_on_n_train():
    few, many = ({"n_train": n} for n in (10, 500))
    assert generate_split("arithmetic", "test", few) == generate_split("arithmetic", "test", many)


def test_arithmetic_labels_are_the_answers():
    for p in generate_split("arithmetic", "train", {"n_train": 50, "ops": ["-", "*"]}):
        a, op, b = p.metadata["expression"].split()
        assert op in "-*"
        assert p.label == str(int(a) - int(b) if op == "-" else int(a) * int(b))
        assert p.prompt == f"What is {a} {op} {b}? Put the final answer in \\boxed{{}}."


def test_countdown_is_solvable_by_its_own_reward():
    reward = get_reward(get_task("countdown").default_reward)
    for p in generate_split("countdown", "train", {"n_train": 50}):
        assert 3 <= len(p.label["numbers"]) <= 4
        assert reward(f"\\boxed{{{p.metadata['solution']}}}", p.label, p.metadata) == 1.0


def test_default_rewards_are_registered():
    for task in TASKS.values():
        get_reward(task.default_reward)


def test_unknown_argument_names_it_and_the_valid_ones():
    with pytest.raises(ValueError, match=r"n_trian.*valid: n_train, n_test, seed, max_operand, ops"):
        generate_split("arithmetic", "train", {"n_trian": 5})


def test_bad_arguments_and_names():
    with pytest.raises(ValueError, match="ops"):
        generate_split("arithmetic", "train", {"ops": ["/"]})
    with pytest.raises(ValueError, match="unknown task 'sudoku'.*arithmetic, countdown"):
        generate_split("sudoku", "train")
    with pytest.raises(ValueError, match="unknown split"):
        generate_split("arithmetic", "validation")


def test_too_small_space_raises():
    with pytest.raises(ValueError, match="too small"):
        generate_split("arithmetic", "train", {"n_train": 100, "max_operand": 2, "ops": ["+"]})
