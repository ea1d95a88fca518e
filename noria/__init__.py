"""Noria: reinforcement-learning post-training of large language models.

Top-level packages are runtime roles: ``models`` (native model definitions shared by engine and
trainer), ``data`` (prompt sources and synthetic tasks), ``rewards`` (scoring), ``eval``
(accuracy on a task's test split). ``types`` and ``config`` are leaves that every role imports;
``hardware`` knows the CPU.

The Python API, loaded on first use so that ``import noria`` stays cheap (docs/python.md)::

    noria.train(model=..., dataset=..., reward_funcs=[...], **overrides) -> run folder
    noria.Engine(model).generate(["prompt", ...]) -> ["completion", ...]
    noria.register_reward(name, fn), noria.get_reward(name), noria.REWARDS (the reward registry)

Their home is ``noria.launch.api`` (and ``noria.rewards.registry`` for the registry). ``noria.train``
is also the trainer's package: reached as an attribute it is that package, made callable (``_Noria``).
"""

import sys as _sys
import types as _types

from noria.hardware import apply_isa_override

# NORIA_CPU_ISA=avx2 must reach torch, oneDNN and MKL before their first CPU op (see noria.hardware).
apply_isa_override()

__version__ = "0.1.0"

_LAZY = {
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
    return sorted([*globals(), *_LAZY, "train"])


class _TrainPackage(_types.ModuleType):
    """The class of the package ``noria.train`` (the trainer) once reached as ``noria.train``: the
    package, whose modules import as always, and callable as the Python API's ``train``."""

    def __call__(self, *args, **kwargs):
        """``noria.launch.api.train``: train as ``noria train`` does; returns the run folder."""
        from noria.launch.api import train

        return train(*args, **kwargs)


class _Noria(_types.ModuleType):
    """The class of this package's module. ``noria.train`` names both the trainer package and the
    function of the Python API: the attribute is a property that returns the package, made callable
    (``_TrainPackage``), so that ``noria.train(...)`` and ``import noria.train.fsdp`` both work, whether
    or not the package was imported before (the import system stores it through the setter)."""

    @property
    def train(self):
        package = self.__dict__.get("train")
        if package is None:
            import importlib

            package = importlib.import_module("noria.train")
        if type(package) is _types.ModuleType:
            package.__class__ = _TrainPackage
        return package

    @train.setter
    def train(self, value) -> None:
        self.__dict__["train"] = value


_sys.modules[__name__].__class__ = _Noria
