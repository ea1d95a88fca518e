"""Reward functions by name: the built-ins, and user functions loaded by import path ``pkg.module:fn``.

The contract (the plug point ``reward.name`` of ``noria.plugins``, pinned by
tests/test_plugin_contracts.py and tests/rewards/test_rewards_runner.py): a reward is
``fn(response: str, label, metadata: dict, **kwargs) -> float | bool``, plain or ``async def``;
``kwargs`` come from ``RewardConfig.kwargs``. For image samples (``Sample.image`` set, see
``noria.diffusion.rewards``) the first argument is the image, a uint8 array [H, W, C]. It returns a finite number; it raises when it cannot
score (the runner then marks the sample failed with the error). A response that is simply wrong
scores 0.0. An unknown name, or an import path that cannot be loaded or does not take
``(response, label, metadata)``, is a ``PluginError`` naming ``reward.name``.

Not guaranteed: the keyword arguments of ``reward.kwargs`` are checked only when the function is
called (an unexpected one becomes a failed sample naming the TypeError).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from noria.rewards.builtin import exact_match, format_reward, numeric
from noria.rewards.countdown import countdown_reward
from noria.plugins import PluginError, load_plugin
from noria.rewards.math_reward import math_reward

RewardFn = Callable[..., Any]
"""``(response, label, metadata, **kwargs) -> float | bool``, or a coroutine function returning one."""

REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "numeric": numeric,
    "math": math_reward,
    "format": format_reward,
    "countdown": countdown_reward,
}


def register_reward(name: str, fn: RewardFn) -> RewardFn:
    """Add ``fn`` under ``name``; names holding ``:`` are import paths and cannot be registered."""
    if ":" in name:
        raise ValueError(f"reward name {name!r} must not contain ':' (that form is an import path)")
    if name in REWARDS:
        raise ValueError(f"reward {name!r} is already registered")
    REWARDS[name] = fn
    return fn


def get_reward(name: str) -> RewardFn:
    """The reward registered as ``name``, or the function at import path ``pkg.module:fn``
    (``noria.plugins.load_plugin``, plug point ``reward.name``); ``PluginError`` otherwise."""
    if ":" in name:
        return load_plugin(name, "reward.name")
    if name not in REWARDS:
        raise PluginError(f"reward.name: unknown reward {name!r}; registered: {', '.join(sorted(REWARDS))}, or use pkg.module:fn")
    return REWARDS[name]


def prepared_reward(name: str, kwargs: dict[str, Any] | None = None) -> RewardFn:
    """:func:`get_reward`, then the function's ``prepare(**kwargs)`` where it has one, once, before
    the run's first call: a reward that builds or loads a model (the digit classifier of
    ``noria.diffusion.rewards``) does it here rather than inside its first call's ``reward.timeout_s``."""
    fn = get_reward(name)
    prepare = getattr(fn, "prepare", None)
    if callable(prepare):
        prepare(**(kwargs or {}))
    return fn


def resolve_reward(config: Any) -> Any:
    """The run's ``RewardConfig`` with ``name`` filled in: the configured one, else the task's own."""
    import dataclasses

    if config.reward.name is not None:
        return config.reward
    from noria.data.tasks import get_task
    from noria.errors import NoriaError

    if config.data.task is None:
        raise NoriaError("reward.name is required when prompts come from data.path (only tasks have a default reward)")
    return dataclasses.replace(config.reward, name=get_task(config.data.task).default_reward)


def eval_reward(reward: Any) -> Any:
    """The reward that scores held-out answers: with a judge (``reward.model``) and a rule, the rule
    alone (accuracy is ground truth, whatever the judge says); otherwise ``reward`` itself."""
    import dataclasses

    from noria.config.reward import RewardModelConfig

    if reward.model.kind == "none" or reward.name is None:
        return reward
    return dataclasses.replace(reward, model=RewardModelConfig())
