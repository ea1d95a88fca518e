"""RL objectives of flow-matching image models (``diffusion.objective``): Flow-GRPO and DiffusionNFT.

A registry like those of ``noria.train.algorithms`` (the same ``register`` / ``lookup``: a name
registered twice is refused, an unknown one raises ``UnknownAlgorithmError`` naming
``diffusion.objective``), keyed by name; each entry says which kind of micro-batch it trains on
and computes its loss from the models' velocity predictions (pure tensor code: the trainer,
``noria.diffusion.trainer``, runs the models).

Why here and not in ``noria.train.algorithms``: only the diffusion trainer uses them, and Flow-GRPO
rebuilds the SDE transition of ``noria.diffusion.sde``, which the diffusion engine samples with.
``noria.diffusion`` sits above ``noria.train`` (it imports the registry helpers, ``LossNorm`` and
``rl_loss`` from there), so with the objectives in this package no import runs from ``train`` back
up into ``diffusion``. The kinds:

- ``transition`` (``flow_grpo``): pairs (image, denoising step j) of the recorded SDE trajectory;
  the loss sees the policy's velocity at x_j (with grad) and the reference's (without), and
  rebuilds the Gaussian transition x_j -> x_{j+1} (``noria.diffusion.sde``);
- ``forward`` (``diffusion_nft``): pairs (final image x_0, noise draw): x_t = (1 - t) x_0 + t eps on
  the forward process, the target velocity eps - x_0; no likelihood, so any sampler (ODE too)
  may have produced x_0.

Flow-GRPO (Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL", 2025): each trained
step is one "token" of the text objective: its log-probability, the group-normalised advantage
of its image (clipped to ``diffusion.adv_clip``), and the configured policy loss (``ppo_clip``:
the clipped per-step ratio), off-policy correction and aggregation of
``noria.train.objective.rl_loss``; the KL to the reference is Flow-GRPO's, on the mean of the
transition (``|mu - mu_ref|^2 / (2 std^2)``, mean over dimensions), weighted by
``train.loss.kl_coef``.

DiffusionNFT (Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process",
2025; its code's ``train_nft_sd3.py``): the advantage becomes an optimality weight
r = (clip(A, -c, c) / c + 1) / 2 in [0, 1]; with v the policy's velocity and v_old the sampling
policy's, the implicit positive policy is v+ = beta v + (1 - beta) v_old and the negative one
v- = (1 + beta) v_old - beta v; the loss pulls x_0-predictions x_t - t v+ towards x_0 with weight r
and x_t - t v- with weight 1 - r, each squared error divided by its (detached) mean absolute error,
scaled by c / beta; the KL to the reference is the mean squared velocity difference. Written by
hand: neither objective exists in diffusers or peft.

Not guaranteed: DiffusionNFT's EMA "old" policy (here the old policy is the weights that sampled
the step's images); Flow-GRPO's CFG during training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from noria.config import LossConfig
from noria.diffusion.sde import mean_kl, transition, transition_logprob, transition_mean
from noria.train.algorithms.aggregation import LossNorm
from noria.train.algorithms.registry import lookup, register
from noria.train.objective import rl_loss

Metrics = dict[str, tuple[float, float]]


@dataclass(frozen=True)
class DiffusionMicroBatch:
    """One micro-batch of n training pairs; tensors on the compute device, float32 unless noted."""

    labels: torch.Tensor
    """LongTensor [n]: class condition of each pair's image."""
    x: torch.Tensor
    """[n, C, H, W]: the latent the models see (x_j of the trajectory, or x_t of the forward process)."""
    sigma: torch.Tensor
    """[n]: its noise level."""
    advantages: torch.Tensor
    """[n]: the advantage of the pair's image (already clipped to diffusion.adv_clip)."""
    seq_index: torch.Tensor
    """LongTensor [n]: each pair's image, numbered 0, 1, ... within the micro-batch (for per-image aggregations)."""
    norm: LossNorm
    """Pairs (``total_tokens``) and images (``total_seqs``) of the whole optimizer step."""
    x_next: torch.Tensor | None = None
    """transition: [n, C, H, W] the recorded x_{j+1}."""
    sigma_next: torch.Tensor | None = None
    """transition: [n] the next noise level."""
    sigma_max: torch.Tensor | None = None
    """transition: [n] the schedule's second level (stands in for s = 1 in the SDE's std)."""
    noise_level: torch.Tensor | None = None
    """transition: [n] the SDE noise level a the image was sampled with."""
    rollout_logprobs: torch.Tensor | None = None
    """transition: [n] the engine's log-probability of x_{j+1} (mean over dimensions)."""
    old_logprobs: torch.Tensor | None = None
    """transition: [n] the trainer's log-probability at the start of the rollout step (None: the current one, detached)."""
    x0: torch.Tensor | None = None
    """forward: [n, C, H, W] the final image's latent."""


@dataclass(frozen=True)
class DiffusionObjective:
    """A registered objective: the pairs it trains on and its loss."""

    kind: str
    """``transition`` or ``forward`` (see the module docstring)."""
    loss: Callable[..., tuple[torch.Tensor, Metrics]]
    """``loss(cfg, dcfg, mb, v, v_old, v_ref) -> (loss of the micro-batch, metrics)``; ``v`` carries
    the gradient, ``v_old`` (forward kind) and ``v_ref`` (None unless kl_coef > 0) do not."""


DIFFUSION_OBJECTIVES: dict[str, DiffusionObjective] = {}
"""Diffusion RL objectives by name (``diffusion.objective``)."""


def register_diffusion_objective(name: str, kind: str) -> Callable[[Callable], Callable]:
    """Decorator registering ``loss`` under ``name`` as an objective of ``kind``."""
    if kind not in ("transition", "forward"):
        raise ValueError(f"objective kind must be transition or forward, got {kind!r}")

    def add(fn: Callable) -> Callable:
        register(DIFFUSION_OBJECTIVES, "diffusion objective", name)(DiffusionObjective(kind, fn))
        return fn

    return add


def get_diffusion_objective(name: str) -> DiffusionObjective:
    return lookup(DIFFUSION_OBJECTIVES, "diffusion objective", name, "diffusion.objective")


def clip_advantages(advantages: list[float], clip: float) -> list[float]:
    return [max(-clip, min(clip, a)) for a in advantages]


@register_diffusion_objective("flow_grpo", "transition")
def flow_grpo(cfg: LossConfig, dcfg: Any, mb: DiffusionMicroBatch, v: torch.Tensor, v_old: Any, v_ref: Any):
    """Flow-GRPO's loss of one micro-batch of (image, step) pairs; see the module docstring."""
    step = transition(mb.sigma, mb.sigma_next, mb.sigma_max, mb.noise_level, latent_dims=mb.x.dim() - 1)
    mean = transition_mean(mb.x, v, step)
    lp = transition_logprob(mb.x_next, mean, step)
    old = lp.detach() if mb.old_logprobs is None else mb.old_logprobs
    mask = torch.ones_like(lp)
    loss, metrics = rl_loss(
        dataclasses.replace(cfg, kl_coef=0.0), logprobs=lp, old_logprobs=old, rollout_logprobs=mb.rollout_logprobs,
        advantages=mb.advantages, loss_mask=mask, seq_index=mb.seq_index, norm=mb.norm,
    )  # fmt: skip
    if v_ref is not None:
        kl = mean_kl(mean, transition_mean(mb.x, v_ref, step), step)
        loss = loss + cfg.kl_coef * kl.sum() / max(mb.norm.total_tokens, 1.0)
        metrics["ref_kl"] = (float(kl.detach().sum()), float(len(kl)))
        metrics["loss"] = (float(loss.detach()), metrics["loss"][1])
    return loss, metrics


@register_diffusion_objective("diffusion_nft", "forward")
def diffusion_nft(cfg: LossConfig, dcfg: Any, mb: DiffusionMicroBatch, v: torch.Tensor, v_old: torch.Tensor, v_ref: Any):
    """DiffusionNFT's loss of one micro-batch of (image, noise draw) pairs; see the module docstring."""
    beta, c = dcfg.nft_beta, dcfg.adv_clip
    r = (mb.advantages.clamp(-c, c) / c + 1) / 2
    t = mb.sigma.view(-1, *([1] * (mb.x.dim() - 1)))
    positive = beta * v + (1 - beta) * v_old
    negative = (1 + beta) * v_old - beta * v
    pos_loss = _weighted_x0_error(mb.x - t * positive, mb.x0)
    neg_loss = _weighted_x0_error(mb.x - t * negative, mb.x0)
    per_pair = (r * pos_loss + (1 - r) * neg_loss) * (c / beta)
    n = float(len(per_pair))
    loss = per_pair.sum() / max(mb.norm.total_tokens, 1.0)
    metrics: Metrics = {
        "policy_loss": (float(per_pair.detach().sum()), n),
        "nft/positive_loss": (float(pos_loss.detach().sum()), n),
        "nft/negative_loss": (float(neg_loss.detach().sum()), n),
        "nft/optimality_mean": (float(r.sum()), n),
    }
    if v_ref is not None:
        kl = ((v - v_ref) ** 2).flatten(1).mean(1)
        loss = loss + cfg.kl_coef * kl.sum() / max(mb.norm.total_tokens, 1.0)
        metrics["ref_kl"] = (float(kl.detach().sum()), n)
    metrics["loss"] = (float(loss.detach()), n / max(mb.norm.total_tokens, 1.0))
    return loss, metrics


def _weighted_x0_error(x0_pred: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """Per pair: mean squared error of an x_0 prediction over its detached mean absolute error."""
    err = (x0_pred - x0).flatten(1)
    scale = err.detach().abs().double().mean(1).clamp(min=1e-5).to(err.dtype)
    return (err * err).mean(1) / scale
