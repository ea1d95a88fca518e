"""Noria's configuration: one typed, closed, documented section per component, and ``RunConfig``.

Where the sections live: all of them here, one module per section, rather than each beside its
component. A config is read by every layer (the engine server reads ``engine``, the launchers read
everything, ``noria config`` and ``noria docs`` read it with no component loaded), so the sections
form one leaf package that imports nothing of Noria but ``noria.errors`` and, when ``dtype: auto`` is
resolved, ``noria.hardware``. Loading a config therefore never imports a component, and no
component's ``__init__`` needs lazy imports to stay light. Each section still names its owner in its
docstring: the component that reads it and whose rules its ``validate()`` holds.

Modules::

    schema.py     the machinery: YAML + dotted overrides -> typed, closed dataclasses; field docs
    run.py        RunConfig (every section), the checks across sections, the resolved values, load_config
    model.py      model        data.py     data         reward.py    reward
    rollout.py    rollout (and rollout.buffer)          engine.py    engine
    train.py      train (optim, loss, critic, lora)     megatron.py  train.megatron
    sync.py       sync         eval.py     eval         log.py       log
    opd.py        opd (on-policy distillation)          ray.py       ray (launch: ray)
    diffusion.py  diffusion (an image model run)
    service.py    ServiceConfig: `noria service` (model + service), not part of RunConfig

A config is loaded once (``load_config``; the machinery is ``noria.config.schema``): YAML plus
dotted overrides -> typed sections (closed: an unknown key names the closest valid one) ->
``validate()`` (checks only: each section, then across sections) -> ``resolve()`` (the named steps
that fill in derived values: ``resolve_batch``, ``resolve_dtypes``; the saved config holds their
results) -> sections marked validated. Components built from a loaded config do not check it
again; one built from code checks its section once (``noria.config.schema.ensure_valid``).

``to_dict`` / ``save_config`` write the resolved config (every default filled in) into a run folder.
This ``__init__`` is the package's face: callers import every name from ``noria.config``.
"""

from noria.config.data import DataConfig
from noria.config.diffusion import DiffusionConfig
from noria.config.engine import EngineConfig
from noria.config.eval import EvalConfig
from noria.config.log import LogConfig
from noria.config.megatron import MegatronConfig
from noria.config.model import DEVICE, ModelConfig, check_device
from noria.config.opd import OpdConfig
from noria.config.ray import RayConfig
from noria.config.reward import RewardConfig
from noria.config.rollout import BufferConfig, RolloutConfig
from noria.config.run import (
    RunConfig,
    field_docs,
    load_config,
    resolve_batch,
    resolve_dtypes,
)
from noria.config.schema import (
    ConfigError,
    check_sampling,
    ensure_valid,
    from_dict,
    load,
    option,
    parse_overrides,
    save_config,
    to_dict,
)
from noria.config.service import ServiceConfig, ServiceSection
from noria.config.sync import SyncConfig
from noria.config.train import (
    CriticConfig,
    LoraConfig,
    LossConfig,
    OptimConfig,
    TrainConfig,
)

__all__ = [
    "DEVICE", "BufferConfig", "ConfigError", "CriticConfig", "DataConfig", "DiffusionConfig", "EngineConfig",
    "EvalConfig", "LogConfig", "LoraConfig", "LossConfig", "MegatronConfig", "ModelConfig", "OpdConfig",
    "OptimConfig", "RayConfig", "RewardConfig", "RolloutConfig", "RunConfig", "ServiceConfig", "ServiceSection",
    "SyncConfig", "TrainConfig",
    "check_device", "check_sampling", "ensure_valid", "field_docs", "from_dict", "load", "load_config",
    "option", "parse_overrides", "resolve_batch", "resolve_dtypes", "save_config", "to_dict",
]  # fmt: skip
