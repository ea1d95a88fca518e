"""Plug points loaded by import path ``pkg.module:name``: the one loader, its error, and each point's contract.

Every object a config names by import path goes through :func:`load_plugin`, which imports it,
checks it against the contract of its plug point, and raises :class:`PluginError` (naming the
config key and the path) when it cannot be used. The plug points:

=========================  =====================================================  ============================
config key                 contract (what the caller passes)                      built-in default
=========================  =====================================================  ============================
``rollout.rollout_fn``     ``async fn(ctx, prompts) -> list[Group]``              (none: the built-in rollout)
``rollout.generate_fn``    ``async fn(ctx, sample) -> Sample``                    ``noria.rollout.generate:generate_one``
``rollout.agent_fn``       ``async fn(ctx, prompt, base_url) -> dict``            (none)
``reward.name``            ``fn(response, label, metadata, **kwargs) -> float``   ``noria.rewards.builtin:exact_match``
                           (plain or async), or TRL's batched form
                           ``fn(completions, **kwargs) -> list[float]``
``rollout.buffer.filters`` ``fn(group) -> None | str`` (plain, not async)         ``noria.rollout.buffer:zero_reward_variance``
``rollout.buffer.impl``    a class built as ``cls(capacity=, max_staleness=,      ``noria.rollout.buffer:GroupBuffer``
                           filters=, on_drop=)`` with the methods of
                           ``noria.rollout.buffer.Buffer``
``eval.backend``           a class built as ``cls(config=)`` whose one method     ``noria.eval.vllm_backend:
                           ``evaluate(request) -> list[list[str]]`` answers the   VllmCheckpointBackend``
                           held-out prompts from an HF folder
                           (``noria.eval.checkpoint``)
=========================  =====================================================  ============================

An import path is ``pkg.module:name`` (a module on ``sys.path``) or ``path/to/file.py:name`` (a file, relative to
the working directory, imported under its file name with its folder added to ``sys.path``: a reward module
beside the user's data needs no ``PYTHONPATH``).

What is checked at load (before any model loads): the path's form, the import, the attribute
(``name`` may be dotted), that it is callable (a class for ``rollout.buffer.impl``), async or not
where the point requires it, and that it accepts the arguments its caller passes (the signature of
the default, recorded in :data:`PLUG_POINTS`; ``tests/test_plugin_contracts.py`` pins each default to
its record and runs a user's own path through the same checks:
``NORIA_CONTRACT_ROLLOUT_GENERATE_FN=my.mod:fn pytest tests/test_plugin_contracts.py``).

Not guaranteed: what a plug-in does when called (its return values are checked by its caller: the
rollout function's groups by ``noria.rollout.generate.check_groups``, rewards by the reward runner),
nor the reward's ``**kwargs`` (``reward.kwargs``), which are checked when it is called.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from noria.errors import NoriaError


class PluginError(NoriaError):
    """A plug-in cannot be used: the message names the config key and the import path."""


@dataclass(frozen=True)
class PlugPoint:
    """The contract of one plug point (see the module docstring's table)."""

    params: tuple[str, ...]
    """What the caller passes, in order: positional arguments of a function, keyword arguments of a
    class's constructor. The default's leading parameters carry these names."""
    is_async: bool | None
    """True: must be ``async def``; False: must not be; None: either."""
    kind: str = "function"
    """``function`` or ``class``."""
    default: str = ""
    """Import path of the built-in default ("" where the built-in is not a plug-in itself)."""
    methods: tuple[str, ...] = ()
    """A class's methods the callers use (``put`` is async)."""
    batched: tuple[str, ...] = ()
    """A second, batched form of a function (TRL's reward functions): the keyword arguments its caller
    passes, the first of which marks the form (a function with a parameter of that name is batched)."""


BUFFER_METHODS = ("put", "take", "metrics", "__len__", "state_dict", "load_state_dict")

PLUG_POINTS: dict[str, PlugPoint] = {
    "rollout.rollout_fn": PlugPoint(("ctx", "prompts"), True),
    "rollout.generate_fn": PlugPoint(("ctx", "sample"), True, default="noria.rollout.generate:generate_one"),
    "rollout.agent_fn": PlugPoint(("ctx", "prompt", "base_url"), True),
    "reward.name": PlugPoint(
        ("response", "label", "metadata"), None, default="noria.rewards.builtin:exact_match",
        batched=("completions", "prompts", "completion_ids"),
    ),
    "rollout.buffer.filters": PlugPoint(("group",), False, default="noria.rollout.buffer:zero_reward_variance"),
    "rollout.buffer.impl": PlugPoint(
        ("capacity", "max_staleness", "filters", "on_drop"), None, "class", "noria.rollout.buffer:GroupBuffer", BUFFER_METHODS
    ),
    "eval.backend": PlugPoint(("config",), None, "class", "noria.eval.vllm_backend:VllmCheckpointBackend", ("evaluate",)),
}


def load_plugin(path: str, key: str) -> Any:
    """The object at ``pkg.module:name``, checked against plug point ``key``'s contract (any other
    ``key`` is only imported and checked for form); raises :class:`PluginError`."""
    obj = import_path(path, key)
    point = PLUG_POINTS.get(key)
    if point is not None:
        check_contract(obj, point, path, key)
    return obj


def import_path(path: str, key: str) -> Any:
    """Import ``pkg.module:name`` or ``path/to/file.py:name`` (``name`` may be dotted); errors name ``key`` and ``path``."""
    module_name, sep, name = path.rpartition(":")
    if not sep or not module_name or not name:
        raise PluginError(f"{key}: {path!r} is not an import path of the form pkg.module:name or path/to/file.py:name")
    try:
        obj = import_file(module_name, key) if module_name.endswith(".py") else importlib.import_module(module_name)
    except ImportError as e:
        raise PluginError(f"{key}: cannot import {module_name!r} for {path!r} ({type(e).__name__}: {e})") from e
    for part in name.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{key}: module {module_name!r} has no {name!r} ({path!r})")
        obj = getattr(obj, part)
    return obj


def import_file(file: str, key: str) -> Any:
    """The module of a Python file (relative paths start at the working directory), imported once under
    its file name, as ``python file.py`` would see it: its folder joins ``sys.path`` so that it can import
    the modules beside it. A different module already imported under that name is refused."""
    import importlib.util
    import sys
    from pathlib import Path

    source = Path(file).expanduser().resolve()
    if not source.is_file():
        raise PluginError(f"{key}: {file} not found (relative paths start at {Path.cwd()})")
    name = source.stem
    loaded = sys.modules.get(name)
    if loaded is not None:
        if getattr(loaded, "__file__", None) and Path(loaded.__file__).resolve() == source:
            return loaded
        raise PluginError(f"{key}: {file}: a module named {name!r} is already imported from {getattr(loaded, '__file__', None)}; rename the file")
    if str(source.parent) not in sys.path:
        sys.path.append(str(source.parent))
    spec = importlib.util.spec_from_file_location(name, source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a syntax error or a failing import in the user's file: reported as an import failure
        del sys.modules[name]
        raise ImportError(f"{type(e).__name__}: {e}") from e
    return module


def check_contract(obj: Any, point: PlugPoint, path: str, key: str) -> None:
    """Raise :class:`PluginError` unless ``obj`` can stand at ``point`` (module docstring)."""
    if point.kind == "class":
        _check_class(obj, point, path, key)
        return
    if not callable(obj) or inspect.isclass(obj):
        raise PluginError(f"{key}: {path!r} names a {type(obj).__name__}, not a function")
    is_async = inspect.iscoroutinefunction(obj) or inspect.iscoroutinefunction(getattr(obj, "__call__", None))
    if point.is_async is True and not is_async:
        raise PluginError(f"{key}: {path} must be an async function (async def)")
    if point.is_async is False and is_async:
        raise PluginError(f"{key}: {path} must be a plain function (not async def): its caller does not await it")
    if point.batched and is_batched(obj, point):
        _check_call(obj, (), {k: None for k in point.batched}, path, key, partial=True)
    else:
        _check_call(obj, point.params, {}, path, key)


def is_batched(fn: Any, point: PlugPoint) -> bool:
    """Whether ``fn`` takes the batched form of ``point`` (it names the form's first keyword, e.g. ``completions``)."""
    try:
        return point.batched[0] in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature: the per-sample form
        return False


def _check_class(obj: Any, point: PlugPoint, path: str, key: str) -> None:
    if not inspect.isclass(obj):
        raise PluginError(f"{key}: {path!r} names a {type(obj).__name__}, not a class")
    missing = [m for m in point.methods if not callable(getattr(obj, m, None))]
    if missing:
        raise PluginError(f"{key}: class {path} lacks {', '.join(missing)} (needs {', '.join(point.methods)})")
    if "put" in point.methods and not inspect.iscoroutinefunction(obj.put):
        raise PluginError(f"{key}: {path}.put must be async (async def): the rollout awaits it and it may wait for room")
    _check_call(obj, (), {p: None for p in point.params}, path, key)


def _check_call(
    obj: Any, args: tuple[str, ...], kwargs: dict[str, Any], path: str, key: str, partial: bool = False
) -> None:
    """Whether ``obj`` accepts the caller's arguments (by signature, without calling it). ``partial``:
    other required parameters are allowed (a batched reward's dataset columns, passed by name)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature: its call will tell
        return
    try:
        (signature.bind_partial if partial else signature.bind)(*args, **kwargs)
    except TypeError as e:
        given = ", ".join([*args, *(f"{k}=" for k in kwargs)])
        raise PluginError(f"{key}: {path}{signature} cannot be called as ({given}): {e}") from e
