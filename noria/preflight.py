"""What a config refers to exists: checked by ``noria config`` and before ``noria train`` touches a run folder.

Config loading (``noria.config.schema``: parse, validate, resolve) checks a config's form: keys,
types, ranges, the rules across sections. It does not look outside the config, so a name nobody
registered, an import path that does not import, or a data file that is not there would pass it
and fail later, seconds or minutes into a run. ``check_references`` looks them up, each through
its owner, and raises on the first that is missing, naming the key:

- ``train.loss.advantage`` in the estimator registry (``gae`` included: the critic's) and
  ``train.loss.policy_loss`` in the policy-loss registry (``noria.train.algorithms``);
- ``reward.name``: a registered reward, or an import path loaded and checked against the reward
  plug point's contract (``noria.rewards.registry.get_reward``);
- ``rollout.buffer.filters`` and ``rollout.buffer.impl``, ``rollout.rollout_fn`` / ``generate_fn`` /
  ``agent_fn``, and ``eval.backend`` (``eval.mode: checkpoint``): built-in names or import paths
  through the one plug-in loader (``noria.plugins``);
- ``data.task`` registered; ``data.path``, ``data.test_path`` (unless a hub id ``Org/Name``) and a
  ``data.chat_template`` file present here.

It imports the registries (and so torch): about a second, spent only by the commands that run or
show a config, never by ``load_config``, which stays free of anything outside the config (tests and
library callers build configs naming models and files that exist elsewhere).

Not guaranteed: that a file's rows are valid (the data loader reads and checks every row when the
run starts), that ``model.path`` exists (a config may be shown on one machine and run on another;
the run checks it before creating its folder), nor what a plug-in does when called.
"""

from __future__ import annotations

from pathlib import Path

from noria.config import RunConfig
from noria.errors import NoriaError


def check_references(config: RunConfig) -> None:
    """Raise a ``NoriaError`` naming the key of the first registry name, import path or file that is missing."""
    if config.diffusion is not None:  # image runs name their own parts (noria.diffusion)
        return
    _check_data(config)
    if config.train.algorithm == "rl":
        _check_algorithms(config)
        _check_plugins(config)


def _check_algorithms(config: RunConfig) -> None:
    from noria.train.algorithms import get_policy_loss
    from noria.train.algorithms.advantages import check_advantage_name

    check_advantage_name(config.train.loss.advantage)
    get_policy_loss(config.train.loss.policy_loss)


def _check_plugins(config: RunConfig) -> None:
    from noria.plugins import load_plugin
    from noria.rewards.registry import get_reward, resolve_reward
    from noria.rollout.buffer import resolve_filters

    get_reward(resolve_reward(config).name)
    r = config.rollout
    resolve_filters(r.buffer.filters)
    if r.buffer.impl:
        load_plugin(r.buffer.impl, "rollout.buffer.impl")
    for key in ("rollout_fn", "generate_fn", "agent_fn"):
        if getattr(r, key):
            load_plugin(getattr(r, key), f"rollout.{key}")
    if config.eval.every > 0 and config.eval.mode == "checkpoint":
        load_plugin(config.eval.backend, "eval.backend")


def _check_data(config: RunConfig) -> None:
    if config.data.task is not None:
        from noria.data.tasks import get_task, resolve_task_args

        try:
            resolve_task_args(get_task(config.data.task), config.data.task_args)
        except ValueError as e:  # the task registry's own words, under the config key
            raise NoriaError(f"data.task: {e}") from e
    if isinstance(config.data.chat_template, str):
        from noria.data.chat import resolve_chat_template

        resolve_chat_template(config.data.chat_template)
    from noria.data.hub import is_hub_dataset

    for key in ("path", "test_path"):
        value = getattr(config.data, key)
        if value is not None and not Path(value).exists() and not is_hub_dataset(value):  # a hub id: read at run start
            raise NoriaError(f"data.{key}: {value} not found (relative paths start at {Path.cwd()})")
