"""The value model (critic) for PPO with GAE (``train.loss.advantage: gae``).

How a PPO step runs (``ppo_train``)::

    samples --pack--> TrainBatch --critic.compute_values--> V [N] (no grad)
      -> gae_targets: outcome reward on each response's last policy token, GAE over policy tokens
         (tool / environment tokens skipped), advantages whitened over the step's policy tokens,
         returns R = A + V (before whitening)
      -> policy.train_step(batch with per-token advantages)      (the usual RL objective)
      -> critic.train_values(batch, returns, V)                   (clipped value loss)

The critic is its own model (``train.critic.path``, default a copy of the policy's starting weights)
with a scalar value head in place of the LM head, trained by its own AdamW (``train.critic.lr``) on
the same backend machinery as the policy: single process or FSDP2, bf16 compute with fp32 masters,
token-budget micro-batches, shared-prefix packing, committed DCP checkpoints.

Alignment: the value of token t is V(state before t), read from the hidden state that predicts t
(the same position its log-probability comes from), so values, logprobs and advantages of a token
all live at that token's index. The value after a response's last token is 0 (the episode ended;
a length-truncated response is not bootstrapped, as in verl).

Value loss (PPO2 / verl): ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``,
token mean over the step, times ``train.loss.value_coef``; ``train.critic.value_clip: null`` drops
the clipped term.

Reference: Schulman et al., "Proximal Policy Optimization Algorithms" (2017); Ouyang et al.,
"Training language models to follow instructions with human feedback" (2022).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import nn

from noria.config import LossConfig, TrainConfig
from noria.train.algorithms.advantages import EPS, gae
from noria.train.backend import TrainError
from noria.train.fsdp import FSDPBackend
from noria.train.packed_forward import packed_hidden, wanted_sources
from noria.train.packing import batch_to, pack_samples, slice_batch
from noria.types import Sample, TrainBatch


class ValueModel(nn.Module):
    """The decoder with a scalar value head: packed ids -> V [N] at the tokens asked for (0 elsewhere)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        args = getattr(lm, "args", None)
        hidden = args.hidden_size if args is not None else lm.config.hidden_size
        self.value_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.value_head.weight)  # V = 0 at the start: no made-up baseline
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, positions, cu_seqlens, with_entropy: bool = False, parents=None, want=None):
        hidden = packed_hidden(self.lm, input_ids, positions, cu_seqlens, parents)
        src, dst = wanted_sources(cu_seqlens, positions, parents, want)
        values = self.value_head(hidden.index_select(0, src)).squeeze(-1).float()
        out = torch.zeros(input_ids.numel(), dtype=torch.float32, device=hidden.device)
        return out.index_copy(0, dst, values), None


def critic_train_config(cfg: TrainConfig) -> TrainConfig:
    """The trainer config the critic runs with: the policy's, with the critic's learning rate and no
    reference, teacher or LoRA (the critic trains fully)."""
    out = copy.deepcopy(cfg)
    out.optim.lr = cfg.critic.lr
    out.lora.enabled = False
    out.teacher = None
    out.loss.kl_coef = 0.0
    return out


class CriticBackend(FSDPBackend):
    """The value model on the trainer backend; see the module docstring."""

    def __init__(self, cfg: TrainConfig, seed: int = 0) -> None:
        super().__init__(critic_train_config(cfg), loss_fn=_unused_loss, seed=seed)
        self.value_clip = cfg.critic.value_clip
        self.value_coef = cfg.loss.value_coef

    def init(self, model_path, total_steps: int | None = None) -> None:
        """Load the critic from ``train.critic.path``, or from ``model_path`` (the policy's start)."""
        super().init(self.cfg.critic.path or model_path, total_steps)

    def _head_model(self, lm: nn.Module) -> nn.Module:
        return ValueModel(lm)

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """V [N] (fp32, CPU) at every trained token of ``batch`` (0 elsewhere)."""
        return self.compute_logprobs(batch, "current", trained_only=True).logprobs

    def train_values(self, batch: TrainBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        """One optimizer step of the value loss; metrics are named ``critic/...``."""
        if returns.shape != (batch.n_tokens,) or old_values.shape != (batch.n_tokens,):
            raise TrainError(f"train_values: returns and old_values must be [{batch.n_tokens}] (one per token of the batch)")
        batch, keep, _index = self._share(batch)
        returns, old_values = returns[keep], old_values[keep]

        def micro(b, lo_seq, hi_seq, total_tokens, total_seqs):
            return self._value_loss(b, lo_seq, hi_seq, total_tokens, returns, old_values)

        out = self._optimizer_step(batch, micro)
        return {f"critic/{k}": v for k, v in out.items() if k not in ("step", "tokens", "loss_tokens")}

    def _value_loss(self, batch, a, b, total_tokens, returns, old_values):
        mb = batch_to(slice_batch(batch, a, b), self.device)
        lo, hi = int(batch.cu_seqlens[a]), int(batch.cu_seqlens[b])
        values, _ = self._forward(self.policy, mb, False, trained_only=True)
        d = self.device
        ret, old, mask = returns[lo:hi].to(d), old_values[lo:hi].to(d), mb.loss_mask
        err = (values - ret) ** 2
        if self.value_clip is None:
            per_token, clipped = err, torch.zeros_like(err)
        else:
            err_clipped = (old + (values - old).clamp(-self.value_clip, self.value_clip) - ret) ** 2
            per_token, clipped = torch.maximum(err, err_clipped), (err_clipped > err).float()
        value_loss = 0.5 * (per_token * mask).sum() / max(total_tokens, 1.0)
        n = float(mask.sum())
        metrics = {
            "value_loss": (float(0.5 * (per_token * mask).sum().detach()), n),
            "value_clip_frac": (float((clipped * mask).sum()), n),
            "value_mean": (float((values.detach() * mask).sum()), n),
        }
        return self.value_coef * value_loss, metrics

    def state_dict_for_sync(self, bucket_bytes: int, cast: bool = True):
        raise TrainError("the critic is not sent to rollout engines (only the policy is)")

    def export_hf(self, folder, dtype=None):
        raise TrainError("the critic has a value head, not an LM head: it cannot be exported as a causal LM")


def _unused_loss(inputs):  # the critic trains through train_values, never train_step
    raise TrainError("CriticBackend.train_step is not used: call train_values(batch, returns, old_values)")


def gae_targets(cfg: LossConfig, batch: TrainBatch, values: torch.Tensor, rewards: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N], returns [N]) for a plainly packed batch (one sequence per sample, in order).

    Each sequence's outcome reward sits on its last trained token; GAE (``cfg.gamma``, ``cfg.lam``)
    runs over trained tokens only; advantages are whitened over all trained tokens of the batch.
    Both are 0 where ``loss_mask`` is 0."""
    if batch.parents is not None:
        raise TrainError("gae_targets takes a plainly packed batch (pack_samples), not a prefix-tree one")
    if len(rewards) != batch.n_sequences:
        raise TrainError(f"gae_targets: {len(rewards)} rewards for {batch.n_sequences} sequences")
    cu = batch.cu_seqlens.tolist()
    width = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    rows = len(rewards)
    mask = torch.zeros(rows, width)
    vals = torch.zeros(rows, width)
    token_rewards = torch.zeros(rows, width)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        mask[i, : b - a] = batch.loss_mask[a:b]
        vals[i, : b - a] = values[a:b]
        trained = mask[i].nonzero()
        if len(trained):
            token_rewards[i, int(trained[-1])] = float(rewards[i])
    adv, ret = gae(token_rewards, vals, mask, cfg.gamma, cfg.lam)
    keep = mask > 0
    if keep.any():
        mean = adv[keep].mean()
        std = adv[keep].std() if int(keep.sum()) > 1 else torch.zeros(())
        adv = torch.where(keep, (adv - mean) / (std + EPS), torch.zeros_like(adv))
    flat_adv, flat_ret = torch.zeros(batch.n_tokens), torch.zeros(batch.n_tokens)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        flat_adv[a:b], flat_ret[a:b] = adv[i, : b - a], ret[i, : b - a]
    return flat_adv, flat_ret


def ppo_train(
    policy: FSDPBackend, critic: CriticBackend, samples: list[Sample], cfg: TrainConfig, steps: int, batch: TrainBatch | None = None
) -> list[dict[str, float]]:
    """PPO with GAE on one rollout step's samples: ``steps`` optimizer steps of policy and critic.

    Values, advantages and returns come from the critic before any update (the usual PPO order);
    with ``steps`` > 1 the policy's pre-update logprobs are the ``old`` ones of every slice.
    ``batch``: ``pack_samples(samples)`` when the caller has packed them already."""
    batch = pack_samples(samples) if batch is None else batch
    values = critic.compute_values(batch)
    advantages, returns = gae_targets(cfg.loss, batch, values, [s.reward for s in samples])
    batch = dataclasses.replace(batch, advantages=advantages)
    cu = batch.cu_seqlens.tolist()
    size = math.ceil(len(samples) / steps)
    bounds = [(i, min(i + size, len(samples))) for i in range(0, len(samples), size)]
    parts = [slice_batch(batch, a, b) for a, b in bounds]
    old = [policy.compute_logprobs(p).logprobs for p in parts] if len(parts) > 1 else [None]
    out = []
    for (a, b), part, old_lp in zip(bounds, parts, old):
        lo, hi = cu[a], cu[b]
        metrics = policy.train_step(part, old_logprobs=old_lp)
        metrics.update(critic.train_values(part, returns[lo:hi], values[lo:hi]))
        trained = part.loss_mask > 0
        explained = explained_variance(values[lo:hi][trained], returns[lo:hi][trained])
        if explained is not None:
            metrics["critic/explained_variance"] = explained
        out.append(metrics)
    return out


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float | None:
    """1 - Var(R - V) / Var(R): 1 is a perfect critic, 0 no better than a constant; None when the
    returns do not vary (or there are none)."""
    if returns.numel() < 2 or returns.var(unbiased=False) == 0:
        return None
    return float(1 - (returns - values).var(unbiased=False) / returns.var(unbiased=False))
