"""Flow-matching sampling math: the noise schedule, the ODE step, and Flow-GRPO's SDE step with its
Gaussian transition log-probability.

The model is a rectified flow: ``x_s = (1 - s) x_0 + s eps`` for noise level ``s`` (sigma) in
[0, 1], and the network predicts the velocity ``v = eps - x_0``. Sampling walks the schedule
``sigmas[0] = 1 > sigmas[1] > ... > sigmas[T] = 0`` (diffusers' ``FlowMatchEulerDiscreteScheduler``
makes it, shift included, so the schedule is the one SD3 pipelines use). One step from ``s`` to
``s'`` (``dt = s' - s < 0``):

- ODE (deterministic, what evaluation uses): ``x' = x + dt v``;
- SDE (Flow-GRPO, Liu et al. 2025, eq. 9 and its code's ``sde_step_with_logprob``): the ODE turned
  into an SDE with the same marginals, noise level ``a``::

      std_s = a sqrt(s / (1 - s))                    (s = 1 uses sigmas[1] in the denominator)
      mean  = x (1 + std_s^2 dt / (2 s)) + v (1 + std_s^2 (1 - s) / (2 s)) dt
      x'    = mean + std_s sqrt(-dt) eps,             eps ~ N(0, I)

  so each denoising step is a Gaussian transition ``N(mean, (std_s sqrt(-dt))^2 I)`` and has a
  log-probability.

Written by hand because diffusers has no SDE step with a log-probability (its flow-matching
scheduler only steps the ODE). Everything here is elementwise per sample, in float32, so a sample's
numbers do not depend on the batch it shares: the engine and the trainer call the same functions.

The log-probability is the MEAN over latent dimensions of the per-dimension Gaussian log density,
as Flow-GRPO's code computes it (not the sum): the ratio ``exp(lp - lp_old)`` is then a
per-dimension geometric mean, and the clip range is set on that scale (Flow-GRPO: 1e-4 to 1e-3).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

TIMESTEP_SCALE = 1000.0
"""The network's timestep input is ``sigma * TIMESTEP_SCALE`` (diffusers' num_train_timesteps)."""
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def flow_sigmas(steps: int, shift: float = 1.0) -> torch.Tensor:
    """The ``steps + 1`` noise levels of a sampling run, 1 down to 0 (float32, CPU), as diffusers'
    ``FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(steps)`` makes them."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=int(TIMESTEP_SCALE), shift=shift)
    scheduler.set_timesteps(steps, device="cpu")
    return scheduler.sigmas.to(torch.float32).clone()


class Transition(NamedTuple):
    """The per-sample numbers of one SDE step's Gaussian transition, computed once from its noise
    levels (:func:`transition`). Each field has the shape of the levels it came from followed by
    ``latent_dims`` ones, so that it broadcasts over latents; ``density`` has the levels' shape."""

    x_scale: torch.Tensor
    """``1 + std_s^2 dt / (2 s)``: the mean's factor on x."""
    v_scale: torch.Tensor
    """``1 + std_s^2 (1 - s) / (2 s)``: the mean's factor on v (then times dt)."""
    dt: torch.Tensor
    """``s' - s`` (< 0)."""
    std: torch.Tensor
    """``std_s sqrt(-dt)``: the transition's standard deviation (0 for the ODE)."""
    neg_two_var: torch.Tensor
    """``-2 std^2`` (std taken as 1 where it is 0)."""
    log_std: torch.Tensor
    """``log std`` (0 where std is 0)."""
    density: torch.Tensor
    """``std > 0``: the step has a log-probability (a deterministic step has no density to train on)."""


def transition(sigma: torch.Tensor, sigma_next: torch.Tensor, sigma_max: torch.Tensor, noise_level: torch.Tensor,
               latent_dims: int = 3) -> Transition:
    """:class:`Transition` of the steps from ``sigma`` to ``sigma_next`` (same shape, any: [N] for N
    samples, or [B, T] for T steps of B samples at once), ``sigma_max`` the schedule's second level
    (the stand-in for s = 1 in ``std_s``'s denominator) and ``noise_level`` ``a`` (0: the ODE).

    Every number is elementwise and correctly rounded in float32 (``log`` is position-independent on
    CPU and CUDA), so a sample's numbers are the same bits whatever the shape it was computed in: the
    engine computes a whole batch's steps at once and the trainer one micro-batch of transitions."""
    shape = (*sigma.shape, *([1] * latent_dims))
    s, nxt, s_max, a = (t.float().reshape(shape) for t in (sigma, sigma_next, sigma_max, noise_level))
    dt = nxt - s
    denominator = 1 - torch.where(s == 1, s_max, s)
    var_rate = a**2 * s / denominator  # std_s^2
    std = a * torch.sqrt(s / denominator) * torch.sqrt(s - nxt)
    density = std > 0
    safe = torch.where(density, std, torch.ones_like(std))
    return Transition(
        x_scale=1 + var_rate * dt / (2 * s), v_scale=1 + var_rate * (1 - s) / (2 * s), dt=dt, std=std,
        neg_two_var=-(2 * safe * safe), log_std=torch.log(safe), density=density.reshape(sigma.shape),
    )  # fmt: skip


def transition_mean(x: torch.Tensor, v: torch.Tensor, t: Transition) -> torch.Tensor:
    """Mean [B, ...] of the SDE transition (float32); ``noise_level`` 0 gives the ODE step."""
    return x.float() * t.x_scale + v.float() * t.v_scale * t.dt


def sde_step(x: torch.Tensor, v: torch.Tensor, t: Transition, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One denoising step: (x_next, the transition's mean). With ``noise_level`` 0 for a sample, its
    step is the ODE step. Its log-probability is :func:`transition_logprob` of the two."""
    mean = transition_mean(x, v, t)
    return mean + t.std * noise.float(), mean


def transition_logprob(x_next: torch.Tensor, mean: torch.Tensor, t: Transition) -> torch.Tensor:
    """Mean over latent dimensions of log N(x_next; mean, std^2), per sample (float32, the shape of
    ``t.density``: [B], or [B, T] for T steps at once); 0 where std is 0 (a deterministic step has no
    density to train on). Each sample's mean runs over its own contiguous latent: the same bits
    whatever the leading shape."""
    per_dim = (x_next.float() - mean) ** 2 / t.neg_two_var - t.log_std - _LOG_SQRT_2PI  # -(d^2) / (2 std^2), one op fewer
    return torch.where(t.density, per_dim.flatten(t.density.dim()).mean(-1), 0.0)


def mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, t: Transition) -> torch.Tensor:
    """KL between two transitions of equal std, per dimension, mean over dimensions [B]:
    ``|mean - ref_mean|^2 / (2 std^2)`` (Flow-GRPO's KL to the reference policy)."""
    diff = (mean - ref_mean).float().flatten(1)
    kl = (diff * diff).mean(1) / -t.neg_two_var.flatten()
    return torch.where(t.density, kl, 0.0)


def ode_step(x: torch.Tensor, v: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """Euler step of the flow ODE, ``x + dt v`` (float32; ``dt`` a column [B, 1, ...] per sample)."""
    return x.float() + dt * v.float()
