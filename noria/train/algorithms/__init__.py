"""The RL objective's interchangeable parts, each a plain registry keyed by its config name.

| registry | config field (``train.loss.``) | module |
|---|---|---|
| ``ADVANTAGES`` (+ ``gae``) | ``advantage`` | ``advantages`` |
| ``POLICY_LOSSES`` | ``policy_loss`` | ``policy`` |
| ``KL_ESTIMATORS`` | ``kl_estimator`` | ``kl`` |
| ``AGGREGATIONS`` (+ ``LossNorm``) | ``aggregation`` | ``aggregation`` |
| ``OFF_POLICY`` | ``off_policy`` | ``off_policy`` |

Add one with the matching ``register_*`` decorator; an unknown name raises
``UnknownAlgorithmError`` (a ``NoriaError``) listing the valid names. ``noria.train.objective``
composes them into the loss. Everything here is pure tensor code: no model, no process group.
"""

from noria.train.algorithms.advantages import ADVANTAGES, compute_advantages, gae, register_advantage
from noria.train.algorithms.aggregation import AGGREGATIONS, LossNorm, get_aggregation, register_aggregation
from noria.train.algorithms.kl import KL_ESTIMATORS, get_kl, register_kl
from noria.train.algorithms.off_policy import OFF_POLICY, get_off_policy, register_off_policy
from noria.train.algorithms.policy import POLICY_LOSSES, get_policy_loss, register_policy_loss
from noria.train.algorithms.registry import UnknownAlgorithmError

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "OFF_POLICY",
    "POLICY_LOSSES",
    "LossNorm",
    "UnknownAlgorithmError",
    "compute_advantages",
    "gae",
    "get_aggregation",
    "get_kl",
    "get_off_policy",
    "get_policy_loss",
    "register_advantage",
    "register_aggregation",
    "register_kl",
    "register_off_policy",
    "register_policy_loss",
]
