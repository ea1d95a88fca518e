"""Plain name -> function registries for the RL objective's parts.

Each kind of algorithm (advantage estimator, policy loss, KL estimator, aggregation, off-policy
correction) is a plain ``dict`` keyed by the name a config uses, filled by a ``register_*``
decorator at import time. A name nobody registered raises ``UnknownAlgorithmError`` listing the
valid ones. Registering a name twice is refused, so a plugin cannot silently replace a built-in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from noria.errors import NoriaError

F = TypeVar("F", bound=Callable[..., Any])


class UnknownAlgorithmError(NoriaError):
    """A config names an algorithm that is not registered."""


def register(table: dict[str, Any], kind: str, name: str) -> Callable[[F], F]:
    """Decorator adding ``fn`` to ``table`` under ``name``; ``kind`` only words the error."""

    def add(fn: F) -> F:
        if name in table:
            held = table[name]  # a function, or a record holding one (a diffusion objective)
            where = getattr(held, "__qualname__", type(held).__qualname__)
            raise ValueError(f"{kind} {name!r} is already registered ({held.__module__}.{where})")
        table[name] = fn
        return fn

    return add


def lookup(table: dict[str, F], kind: str, name: str, field: str) -> F:
    """Return ``table[name]``; an unknown name raises an error naming the config ``field`` and the valid names."""
    try:
        return table[name]
    except KeyError:
        valid = ", ".join(sorted(table))
        raise UnknownAlgorithmError(f"{field}: unknown {kind} {name!r}; valid: {valid}") from None
