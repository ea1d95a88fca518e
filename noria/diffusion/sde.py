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


def _col(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-sample values [B] shaped to broadcast over a latent batch [B, ...]."""
    return t.to(like.dtype).view(-1, *([1] * (like.dim() - 1)))


def step_std(sigma: torch.Tensor, sigma_next: torch.Tensor, sigma_max: torch.Tensor, noise_level: torch.Tensor) -> torch.Tensor:
    """Standard deviation [B] of the SDE transition from ``sigma`` to ``sigma_next`` (all [B]):
    ``a sqrt(s / (1 - s)) sqrt(-dt)``, with ``sigma_max`` (the schedule's second level) standing in
    for s = 1 in the denominator."""
    denominator = 1 - torch.where(sigma == 1, sigma_max, sigma)
    return noise_level * torch.sqrt(sigma / denominator) * torch.sqrt(sigma - sigma_next)


def transition_mean(
    x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor, sigma_max: torch.Tensor,
    noise_level: torch.Tensor,
) -> torch.Tensor:
    """Mean [B, ...] of the SDE transition (float32); ``noise_level`` 0 gives the ODE step."""
    x, v = x.float(), v.float()
    s, dt = _col(sigma, x), _col(sigma_next - sigma, x)
    denominator = 1 - torch.where(sigma == 1, sigma_max, sigma)
    var_rate = _col(noise_level**2 * sigma / denominator, x)  # std_s^2
    return x * (1 + var_rate * dt / (2 * s)) + v * (1 + var_rate * (1 - s) / (2 * s)) * dt


def sde_step(
    x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor, sigma_max: torch.Tensor,
    noise_level: torch.Tensor, noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One denoising step: (x_next, log-probability [B] of x_next under the transition). With
    ``noise_level`` 0 for a sample, its step is the ODE step and its log-probability 0."""
    mean = transition_mean(x, v, sigma, sigma_next, sigma_max, noise_level)
    std = step_std(sigma, sigma_next, sigma_max, noise_level)
    x_next = mean + _col(std, mean) * noise.float()
    return x_next, transition_logprob(x_next, mean, std)


def transition_logprob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Mean over latent dimensions of log N(x_next; mean, std^2), per sample [B] (float32); 0 where
    std is 0 (a deterministic step has no density to train on)."""
    safe = torch.where(std > 0, std, torch.ones_like(std))
    s = _col(safe, mean)
    per_dim = -((x_next.float() - mean) ** 2) / (2 * s * s) - torch.log(s) - _LOG_SQRT_2PI
    lp = per_dim.flatten(1).mean(1)
    return torch.where(std > 0, lp, torch.zeros_like(lp))


def mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL between two transitions of equal std, per dimension, mean over dimensions [B]:
    ``|mean - ref_mean|^2 / (2 std^2)`` (Flow-GRPO's KL to the reference policy)."""
    safe = torch.where(std > 0, std, torch.ones_like(std))
    diff = (mean - ref_mean).float().flatten(1)
    kl = (diff * diff).mean(1) / (2 * safe * safe)
    return torch.where(std > 0, kl, torch.zeros_like(kl))


def ode_step(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """Euler step of the flow ODE, ``x + (sigma_next - sigma) v`` (float32)."""
    return x.float() + _col(sigma_next - sigma, x.float()) * v.float()
