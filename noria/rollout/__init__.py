"""Rollout: prompts -> scored groups of trajectories, through an engine client.

Modules::

    client.py    EngineClient: LocalEngineClient (in process) and HttpEngineClient (SGLang HTTP API)
    generate.py  the default generate function and one step's rollout (generate + reward -> groups)
    buffer.py    GroupBuffer: put (waits when full) / take / metrics, drops by reason, staleness on take
    scheduler.py RolloutScheduler: the background worker keeping <= N trajectories in flight

``rollout`` speaks to engines only through the client, never to engine internals (docs/architecture.md).
"""

from noria.rollout.buffer import GroupBuffer, staleness_of
from noria.rollout.client import EngineClient, EngineFailure, HttpEngineClient, LocalEngineClient
from noria.rollout.generate import RolloutContext, RolloutResult, generate_one, rollout_groups, sample_seed

__all__ = [
    "EngineClient",
    "EngineFailure",
    "GroupBuffer",
    "HttpEngineClient",
    "LocalEngineClient",
    "RolloutContext",
    "RolloutResult",
    "generate_one",
    "rollout_groups",
    "sample_seed",
    "staleness_of",
]
