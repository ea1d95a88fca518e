"""Noria: reinforcement-learning post-training of large language models.

Top-level packages are runtime roles: ``models`` (native model definitions shared by engine and
trainer), ``data`` (prompt sources and synthetic tasks), ``rewards`` (scoring), ``eval``
(accuracy on a task's test split). ``types`` and ``config`` are leaves that every role imports;
``hardware`` knows the CPU.

The Python API, loaded on first use so that ``import noria`` stays cheap (docs/python.md)::

    noria.train(model=..., dataset=..., reward_funcs=[...], **overrides) -> run folder
    noria.Engine(model).generate(["prompt", ...]) -> ["completion", ...]
    noria.register_reward(name, fn), noria.get_reward(name), noria.REWARDS (the reward registry)

Their home is ``noria.launch.api`` (and ``noria.rewards.registry`` for the registry).
"""

from noria.hardware import apply_isa_override

# NORIA_CPU_ISA=avx2 must reach torch, oneDNN and MKL before their first CPU op (see noria.hardware).
apply_isa_override()

__version__ = "0.1.0"

_LAZY = {
    "train": "noria.launch.api",
    "Engine": "noria.launch.api",
    "register_reward": "noria.rewards.registry",
    "get_reward": "noria.rewards.registry",
    "REWARDS": "noria.rewards.registry",
}
"""Names of the Python API -> the module that defines them, imported on first access."""


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'noria' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
