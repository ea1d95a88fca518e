"""Per-token KL estimators between the current policy and a reference, from sampled-token logprobs.

Each takes ``logprobs`` [N] (current policy, with gradient) and ``ref_logprobs`` [N] and returns
[N]. The tokens were sampled from (approximately) the current policy, so each is a one-sample
estimate of KL(pi || pi_ref) = E_pi[log pi - log pi_ref]. Reference for k1/k2/k3: Schulman,
"Approximating KL Divergence" (2020).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from noria.train.algorithms.registry import lookup, register

KlFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: dict[str, KlFn] = {}
"""Per-token KL estimators by name (``train.loss.kl_estimator``)."""


def register_kl(name: str) -> Callable[[KlFn], KlFn]:
    """Decorator registering a KL estimator ``fn(logprobs [N], ref_logprobs [N]) -> [N]``."""
    return register(KL_ESTIMATORS, "KL estimator", name)


def get_kl(name: str) -> KlFn:
    """The KL estimator registered as ``name``."""
    return lookup(KL_ESTIMATORS, "KL estimator", name, "train.loss.kl_estimator")


@register_kl("k1")
def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log pi_ref: unbiased, high variance, can be negative per token."""
    return logprobs - ref_logprobs


@register_kl("k2")
def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 (log pi - log pi_ref)^2: biased, low variance, non-negative."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@register_kl("k3")
def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1: unbiased, low variance, non-negative."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


@register_kl("low_var_kl")
def low_var_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 with verl's guards: the log-ratio clamped to [-20, 20] before exp, the result to [-10, 10].

    Reference: Schulman, "Approximating KL Divergence" (2020); verl ``kl_penalty(..., "low_var_kl")``.
    """
    log_ratio = torch.clamp(ref_logprobs - logprobs, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, min=-10.0, max=10.0)
