"""Built-in synthetic tasks: seeded prompt generators with disjoint train and test splits.

What this module owns: a registry of tasks keyed by name (``arithmetic``, ``countdown``, and the
image task ``digits_sum`` of ``noria.data.digits_images``), each with
its closed set of arguments (``DataConfig.task_args``), its default reward name, and a generator of
``Prompt`` records for the ``train`` and ``test`` splits.

How a split is made: a seeded stream of candidate problems is drawn; each distinct prompt text is
assigned to one split by a stable hash of the text (about one in ten goes to test), so the splits
never share a prompt, the test split does not depend on ``n_train``, and the same arguments always
give the same prompts in the same order, on any machine and Python version. A task with its own
``generate`` (``digits_sum``, whose held-out split is made of unseen pictures) makes its splits itself.

Not guaranteed: the problems are not uniformly distributed over the problem space (duplicates are
dropped, so small spaces skew); asking for more prompts than the space holds raises ``ValueError``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from noria.data import digits_images
from noria.types import Prompt

SPLITS = ("train", "test")
TEST_SHARE = 26  # of 256 hash buckets: about 10% of distinct prompts belong to the test split
MAX_DRAWS_PER_PROMPT = 200  # give up (the problem space is too small) after this many draws per prompt

Problem = tuple[str, Any, dict[str, Any]]
"""(prompt text, label, metadata) of one generated problem."""


@dataclass(frozen=True)
class Task:
    """A registered synthetic task."""

    name: str
    default_reward: str
    """Name of the reward (in ``noria.rewards``) that scores this task's answers."""
    defaults: dict[str, Any]
    """Every argument the task accepts, with its default; other keys are rejected."""
    draw: Callable[[random.Random, dict[str, Any]], Problem] | None
    """Draws one random problem given the resolved arguments (None: the task has ``generate``)."""
    check_args: Callable[[dict[str, Any]], None]
    """Raises ``ValueError`` if the resolved arguments are unusable."""
    generate: Callable[[str, dict[str, Any]], list[Prompt]] | None = None
    """Makes a whole split (split name, resolved arguments) when the task splits its own way."""


TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    """Add ``task`` to the registry; a second task with the same name is an error."""
    if task.name in TASKS:
        raise ValueError(f"task {task.name!r} is already registered")
    TASKS[task.name] = task
    return task


def get_task(name: str) -> Task:
    """The registered task ``name``; the error lists the known ones."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def resolve_task_args(task: Task, args: dict[str, Any]) -> dict[str, Any]:
    """The task's defaults updated with ``args``; an unknown key raises naming it and the valid ones."""
    unknown = sorted(set(args) - set(task.defaults))
    if unknown:
        raise ValueError(
            f"task {task.name!r}: unknown argument(s) {', '.join(unknown)}; valid: {', '.join(task.defaults)}"
        )
    resolved = {**task.defaults, **args}
    for key in ("n_train", "n_test"):
        if not isinstance(resolved[key], int) or resolved[key] < 0:
            raise ValueError(f"task {task.name!r}: {key} must be an integer >= 0, got {resolved[key]!r}")
    task.check_args(resolved)
    return resolved


def generate_split(name: str, split: str, args: dict[str, Any] | None = None) -> list[Prompt]:
    """The ``split`` ("train" or "test") prompts of task ``name``, deterministic given ``args``."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    task = get_task(name)
    resolved = resolve_task_args(task, args or {})
    if task.generate is not None:
        return task.generate(split, resolved)
    count = resolved[f"n_{split}"]
    rng = random.Random(f"noria-task:{name}:{split}:{resolved['seed']}")
    problems = _draw_unique(task, rng, resolved, split, count)
    source = f"task:{name}/{split}"
    return [
        Prompt(prompt=text, label=label, metadata={"task": name, **meta}, index=i, source=source)
        for i, (text, label, meta) in enumerate(problems)
    ]


def _draw_unique(task: Task, rng: random.Random, args: dict[str, Any], split: str, count: int) -> list[Problem]:
    seen: set[str] = set()
    problems: list[Problem] = []
    for _ in range(max(1, count) * MAX_DRAWS_PER_PROMPT):
        if len(problems) == count:
            return problems
        problem = task.draw(rng, args)
        if problem[0] not in seen and split_of(problem[0]) == split:
            seen.add(problem[0])
            problems.append(problem)
    if len(problems) == count:
        return problems
    raise ValueError(
        f"task {task.name!r}: found only {len(problems)} distinct {split} prompts of the {count} asked; "
        "the problem space is too small for these arguments (raise max_operand or lower the counts)"
    )


def split_of(text: str) -> str:
    """The split a prompt text belongs to, by a stable hash (the same on every machine)."""
    bucket = hashlib.sha256(text.encode("utf-8")).digest()[0]
    return "test" if bucket < TEST_SHARE else "train"


# ------------------------------------------------------------------------------------- arithmetic

ARITHMETIC_OPS = ("+", "-", "*")


def _draw_arithmetic(rng: random.Random, args: dict[str, Any]) -> Problem:
    a, b = rng.randint(0, args["max_operand"]), rng.randint(0, args["max_operand"])
    op = rng.choice(args["ops"])
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    text = f"What is {a} {op} {b}? Put the final answer in \\boxed{{}}."
    return text, str(answer), {"expression": f"{a} {op} {b}"}


def _check_arithmetic(args: dict[str, Any]) -> None:
    ops = args["ops"]
    if not isinstance(ops, (list, tuple)) or not ops or any(op not in ARITHMETIC_OPS for op in ops):
        raise ValueError(f"task 'arithmetic': ops must be a non-empty list of {list(ARITHMETIC_OPS)}, got {ops!r}")
    if not isinstance(args["max_operand"], int) or args["max_operand"] < 1:
        raise ValueError(f"task 'arithmetic': max_operand must be an integer >= 1, got {args['max_operand']!r}")


register_task(
    Task(
        name="arithmetic",
        default_reward="numeric",
        defaults={"n_train": 1000, "n_test": 100, "seed": 0, "max_operand": 50, "ops": ["+", "-", "*"]},
        draw=_draw_arithmetic,
        check_args=_check_arithmetic,
    )
)


# -------------------------------------------------------------------------------------- countdown


def _draw_countdown(rng: random.Random, args: dict[str, Any]) -> Problem:
    """Numbers and a target reachable by construction: fold a random order of the numbers with ops."""
    count = rng.randint(args["min_numbers"], args["max_numbers"])
    numbers = [rng.randint(1, args["max_operand"]) for _ in range(count)]
    order = rng.sample(numbers, len(numbers))
    value, expression = order[0], str(order[0])
    for n in order[1:]:
        value, expression = _fold_step(rng, value, expression, n)
    text = (
        f"Using the numbers {numbers}, write an arithmetic expression that equals {value}. "
        "You may use +, -, *, / and parentheses, and each number at most once. "
        "Put the final expression in \\boxed{}."
    )
    return text, {"numbers": numbers, "target": value}, {"solution": expression}


def _fold_step(rng: random.Random, value: int, expression: str, n: int) -> tuple[int, str]:
    """Combine the running value with ``n``, keeping every intermediate a positive integer."""
    choices = [("+", value + n), ("*", value * n)]
    if value > n:
        choices.append(("-", value - n))
    if value % n == 0 and n > 1:
        choices.append(("/", value // n))
    op, result = rng.choice(choices)
    return result, f"({expression} {op} {n})"


def _check_countdown(args: dict[str, Any]) -> None:
    lo, hi = args["min_numbers"], args["max_numbers"]
    if not (isinstance(lo, int) and isinstance(hi, int) and 2 <= lo <= hi <= 6):
        raise ValueError(f"task 'countdown': need 2 <= min_numbers <= max_numbers <= 6, got {lo!r}, {hi!r}")
    if not isinstance(args["max_operand"], int) or args["max_operand"] < 2:
        raise ValueError(f"task 'countdown': max_operand must be an integer >= 2, got {args['max_operand']!r}")


register_task(
    Task(
        name="countdown",
        default_reward="countdown",
        defaults={"n_train": 1000, "n_test": 100, "seed": 0, "min_numbers": 3, "max_numbers": 4, "max_operand": 20},
        draw=_draw_countdown,
        check_args=_check_countdown,
    )
)


# ------------------------------------------------------------------------------------- digits_sum


register_task(
    Task(
        name="digits_sum",
        default_reward="numeric",
        defaults=dict(digits_images.DEFAULTS),
        draw=None,
        check_args=digits_images.check_args,
        generate=digits_images.generate,
    )
)
