"""The DiT trainer: flow-matching SFT, the RL step of the diffusion objectives, weights out, checkpoints.

What it owns: the policy's fp32 master weights (and peft LoRA adapters, ``train.lora``), AdamW with
the LR schedule, the reference model (``train.loss.kl_coef`` > 0), and these calls::

    trainer.init(model_path, total_steps, allow_new=...)     # weights (or a new model), optimizer
    trainer.sft_step(latents, labels)                        # one flow-matching optimizer step
    trainer.rl_steps(samples, advantages, k)                 # k optimizer steps on a rollout step
    trainer.transition_logprobs(samples)                     # recomputed per-step log-probs [S, T]
    trainer.state_dict_for_sync(bucket_bytes)                # weights -> engines (full or adapters)
    trainer.save(folder, extra) / trainer.load(folder)       # DCP checkpoint (noria.train.checkpoint)
    trainer.export_hf(folder)                                # a diffusers folder

Numerics: the forward runs in the compute dtype (``train.param_dtype``) from casts of the fp32
masters (``torch.func.functional_call`` with cast parameters and buffers, differentiable back to
the masters), which is exactly the model the engine holds in that dtype. With ``deterministic``
(``engine.deterministic``) the model also runs the batch-invariant kernels
(``noria.diffusion.model.set_exact_numerics``), so the recomputed transition log-probabilities equal
the engine's bit for bit (tests/diffusion/test_diffusion_engine.py).

The RL step (``rl_steps``): the samples are split into ``k`` slices (one optimizer step each,
``train.steps_per_rollout``); the objective (``noria.diffusion.objectives``) names its pairs:
``transition`` (Flow-GRPO): (image, step) pairs, all T steps or ``diffusion.train_steps`` of them
drawn per image; ``forward`` (DiffusionNFT): ``diffusion.nft_timesteps`` noise draws per image. When
``k`` > 1 the policy's outputs at the start of the rollout step (old log-probs / old velocities)
are computed once, before the first update. Pairs go through the model in micro-batches of at most
``train.micro_batch_tokens`` pairs; the loss divides by the step's pair count, so the gradient does
not depend on the split. The model runs in ``eval()`` mode for RL (no label dropout: the trainer
sees what the engine saw) and in ``train()`` mode for SFT.

Randomness (SFT noise and levels, label dropout, step subsets, NFT draws) comes from torch's global
generator, which checkpoints save and restore, so a resumed run repeats the same updates.

Not guaranteed: several trainer processes (FSDP2) for the DiT; CUDA exactness without Triton.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from noria import hardware
from noria.diffusion import sde
from noria.diffusion.model import VelocityNet, load_dit, save_dit, set_exact_numerics
from noria.diffusion.objectives import DiffusionMicroBatch, get_diffusion_objective
from noria.train.algorithms.aggregation import LossNorm
from noria.train.backend import TrainError
from noria.train.step_guard import step_or_skip
from noria.types import Sample

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class DiffusionTrainer:
    """See the module docstring."""

    def __init__(self, cfg: Any, dcfg: Any, seed: int = 0, deterministic: bool = False) -> None:
        self.cfg, self.dcfg, self.seed, self.deterministic = cfg, dcfg, seed, deterministic
        self.dtype = DTYPES[hardware.resolve_dtype(cfg.param_dtype, cfg.device)]
        self.device = torch.device(cfg.device)
        self.optimizer_steps = 0
        """Optimizer steps applied (skipped non-finite steps do not count)."""
        self.nonfinite_streak = 0
        self.rank = 0  # one process (what the run-folder helpers of noria.launch.sft ask)
        self.sigmas = sde.flow_sigmas(dcfg.steps, dcfg.shift)

    # ------------------------------------------------------------------------------------ init

    def init(self, model_path: str | Path, total_steps: int | None = None, allow_new: bool = False) -> None:
        from noria.train.optim import build_optimizer, lr_at, set_lr

        self.model_path, self.total_steps = Path(model_path), total_steps
        torch.manual_seed(self.seed)
        model = load_dit(model_path, torch.float32, "cpu", allow_new=allow_new, seed=self.seed)
        if self.cfg.lora.enabled:
            from noria.train.lora import apply_lora

            model = apply_lora(model, self.cfg.lora)
        self.model = self._prepare(model)
        self.optimizer = build_optimizer(self.model.parameters(), self.cfg.optim)
        set_lr(self.optimizer, lr_at(self.optimizer_steps, self.cfg.optim, total_steps))
        self.reference = None
        if self.cfg.algorithm == "rl" and self.cfg.loss.kl_coef > 0:
            ref = load_dit(model_path, self.dtype, "cpu").requires_grad_(False)
            self.reference = self._prepare(ref)

    def _prepare(self, model: nn.Module) -> nn.Module:
        if self.deterministic:
            set_exact_numerics(model)
        return model.to(self.device)

    def _compute_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Parameters and floating buffers cast to the compute dtype (differentiable casts)."""
        state = {n: p.to(self.dtype) for n, p in model.named_parameters()}
        state.update({n: b.to(self.dtype) for n, b in model.named_buffers() if b.is_floating_point()})
        return state

    def predict(self, x: torch.Tensor, sigma: torch.Tensor, labels: torch.Tensor, model: nn.Module | None = None) -> torch.Tensor:
        """Velocity [n, C, H, W] (float32) of the policy (or ``model``) in the compute dtype."""
        net = VelocityNet(self.model if model is None else model, self.dtype)
        return functional_call(net, self._compute_state(net), (x.to(self.device), sigma.to(self.device), labels.to(self.device)))

    # ------------------------------------------------------------------------------------ SFT

    def sft_step(self, latents: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """One flow-matching optimizer step on clean latents [B, C, H, W] with class ``labels`` [B]."""
        t0 = time.perf_counter()
        self.model.train()  # diffusers' class dropout: the model also learns the unconditional velocity
        self.optimizer.zero_grad(set_to_none=True)
        n = len(latents)
        loss_sum = 0.0
        for lo in range(0, n, self.cfg.micro_batch_tokens):
            x0 = latents[lo : lo + self.cfg.micro_batch_tokens].to(self.device)
            sigma = self.draw_sigmas(len(x0))
            noise = torch.randn_like(x0)
            x_t = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * noise
            v = self.predict(x_t, sigma, labels[lo : lo + len(x0)].to(self.device))
            loss = ((v - (noise - x0)) ** 2).flatten(1).mean(1).sum() / n
            loss.backward()
            loss_sum += float(loss.detach())
        out = self._finish_step(loss_sum)
        patches = n * math.prod(latents.shape[2:]) // self.model.config.patch_size**2  # the transformer's tokens
        out.update(images=float(n), tokens=float(patches), loss_tokens=float(patches), step_time_s=time.perf_counter() - t0)
        return out

    def draw_sigmas(self, n: int) -> torch.Tensor:
        """Training noise levels [n] (``diffusion.sft_sigmas``), in (0, 1)."""
        if self.dcfg.sft_sigmas == "logit_normal":
            s = torch.sigmoid(torch.randn(n))
        else:
            s = torch.rand(n)
        return s.clamp(1e-4, 1 - 1e-4).to(self.device)

    # ------------------------------------------------------------------------------------ RL

    def rl_steps(self, samples: list[Sample], advantages: list[float], k: int = 1) -> list[dict[str, float]]:
        """``k`` optimizer steps on ``samples`` (advantages clipped already), one slice each."""
        objective = get_diffusion_objective(self.dcfg.objective)
        size = math.ceil(len(samples) / k)
        slices = [(samples[i : i + size], advantages[i : i + size]) for i in range(0, len(samples), size)]
        batches = [self.pairs(objective.kind, s, a) for s, a in slices]
        if len(batches) > 1:
            for batch in batches:
                batch["old"] = self._old_outputs(objective.kind, batch)
        return [self._rl_step(objective, batch) for batch in batches]

    def pairs(self, kind: str, samples: list[Sample], advantages: list[float]) -> dict[str, torch.Tensor]:
        """The step's training pairs as CPU tensors (see the module docstring)."""
        self.check_samples(samples)
        if kind == "transition":
            return self._transition_pairs(samples, advantages)
        return self._forward_pairs(samples, advantages)

    def check_samples(self, samples: list[Sample]) -> None:
        want = {"steps": self.dcfg.steps, "shift": self.dcfg.shift}
        for s in samples:
            got = {key: s.metadata.get("diffusion", {}).get(key) for key in want}
            if got != want or s.latents is None:
                raise TrainError(f"sample {s.group_id}/{s.index} was sampled with {got} (latents: {s.latents is not None}); "
                                 f"the trainer's diffusion config says {want}")

    def _transition_pairs(self, samples: list[Sample], advantages: list[float]) -> dict[str, torch.Tensor]:
        t = self.dcfg.steps
        chosen = [self._trained_steps() for _ in samples]
        image = torch.tensor([i for i, steps in enumerate(chosen) for _ in steps])
        step = torch.cat(chosen)
        latents = torch.stack([s.latents for s in samples])  # [S, T+1, C, H, W]
        rollout = torch.tensor([s.rollout_logprobs for s in samples], dtype=torch.float32)
        noise = torch.tensor([float(s.metadata["diffusion"]["noise_level"]) for s in samples])
        assert rollout.shape[1] == t
        return {
            "image": image, "labels": torch.tensor([s.prompt_ids[0] for s in samples])[image],
            "x": latents[image, step], "x_next": latents[image, step + 1], "sigma": self.sigmas[step],
            "sigma_next": self.sigmas[step + 1], "sigma_max": self.sigmas[1].expand(len(step)),
            "noise_level": noise[image], "rollout_logprobs": rollout[image, step],
            "advantages": torch.tensor(advantages, dtype=torch.float32)[image],
        }  # fmt: skip

    def _trained_steps(self) -> torch.Tensor:
        t, k = self.dcfg.steps, self.dcfg.train_steps
        return torch.arange(t) if k is None or k == t else torch.randperm(t)[:k].sort().values

    def _forward_pairs(self, samples: list[Sample], advantages: list[float]) -> dict[str, torch.Tensor]:
        m = self.dcfg.nft_timesteps
        image = torch.arange(len(samples)).repeat_interleave(m)
        x0 = torch.stack([s.latents[-1] for s in samples])[image]
        sigma = torch.rand(len(image)) * (1 - 2e-3) + 1e-3
        noise = torch.randn_like(x0)
        s = sigma.view(-1, 1, 1, 1)
        return {
            "image": image, "labels": torch.tensor([s.prompt_ids[0] for s in samples])[image],
            "x": (1 - s) * x0 + s * noise, "sigma": sigma, "x0": x0,
            "advantages": torch.tensor(advantages, dtype=torch.float32)[image],
        }  # fmt: skip

    def _chunks(self, n: int) -> Iterator[slice]:
        size = self.cfg.micro_batch_tokens
        for lo in range(0, n, size):
            yield slice(lo, min(lo + size, n))

    @torch.no_grad()
    def _old_outputs(self, kind: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Old log-probs [n] (transition) or old velocities [n, ...] (forward) before any update."""
        self.model.eval()
        outs = []
        for sl in self._chunks(len(batch["image"])):
            v = self.predict(batch["x"][sl].to(self.device), batch["sigma"][sl], batch["labels"][sl])
            if kind == "transition":
                v = self._logprob(batch, sl, v)
            outs.append(v.cpu())
        return torch.cat(outs)

    def _logprob(self, batch: dict[str, torch.Tensor], sl: slice, v: torch.Tensor) -> torch.Tensor:
        d = self.device
        args = (batch["sigma"][sl].to(d), batch["sigma_next"][sl].to(d), batch["sigma_max"][sl].to(d), batch["noise_level"][sl].to(d))
        x = batch["x"][sl].to(d)
        step = sde.transition(*args, latent_dims=x.dim() - 1)
        return sde.transition_logprob(batch["x_next"][sl].to(d), sde.transition_mean(x, v, step), step)

    def _rl_step(self, objective: Any, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        from noria.train.objective import reduce_metrics

        t0 = time.perf_counter()
        self.model.eval()  # no class dropout: the trainer recomputes what the engine computed
        self.optimizer.zero_grad(set_to_none=True)
        n = len(batch["image"])
        norm = LossNorm(total_tokens=float(n), total_seqs=float(len(torch.unique(batch["image"]))))
        parts, loss_sum = [], 0.0
        for sl in self._chunks(n):
            mb = self._micro_batch(batch, sl, norm)
            v = self.predict(mb.x, mb.sigma, mb.labels)
            v_old = None
            if objective.kind == "forward":
                v_old = batch["old"][sl].to(self.device) if "old" in batch else v.detach()
            v_ref = None
            if self.reference is not None:
                with torch.no_grad():
                    v_ref = self.predict(mb.x, mb.sigma, mb.labels, model=self.reference)
            loss, metrics = objective.loss(self.cfg.loss, self.dcfg, mb, v, v_old, v_ref)
            loss.backward()
            loss_sum += float(loss.detach())
            parts.append(metrics)
        out = reduce_metrics(parts)
        out.update(self._finish_step(loss_sum))
        out.update({"train/pairs": float(n), "step_time_s": time.perf_counter() - t0})
        return out

    def _micro_batch(self, batch: dict[str, torch.Tensor], sl: slice, norm: LossNorm) -> DiffusionMicroBatch:
        d = self.device
        image = batch["image"][sl]
        fields = {k: batch[k][sl].to(d) for k in ("x_next", "sigma_next", "sigma_max", "noise_level", "rollout_logprobs", "x0") if k in batch}
        if "old" in batch and "x_next" in batch:
            fields["old_logprobs"] = batch["old"][sl].to(d)
        return DiffusionMicroBatch(
            labels=batch["labels"][sl].to(d), x=batch["x"][sl].to(d), sigma=batch["sigma"][sl].to(d),
            advantages=batch["advantages"][sl].to(d), seq_index=(image - image[0]).to(d), norm=norm, **fields,
        )  # fmt: skip

    @torch.no_grad()
    def transition_logprobs(self, samples: list[Sample]) -> torch.Tensor:
        """The policy's log-probability of every recorded step, [S, T] (what the engine reported)."""
        self.model.eval()
        batch = self._transition_pairs_all(samples)
        out = [self._logprob(batch, sl, self.predict(batch["x"][sl].to(self.device), batch["sigma"][sl], batch["labels"][sl])).cpu()
               for sl in self._chunks(len(batch["image"]))]  # fmt: skip
        return torch.cat(out).view(len(samples), self.dcfg.steps)

    def _transition_pairs_all(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        saved, self.dcfg = self.dcfg, _with(self.dcfg, train_steps=None)
        try:
            return self._transition_pairs(samples, [0.0] * len(samples))
        finally:
            self.dcfg = saved

    # ------------------------------------------------------------------------------------ step

    def _finish_step(self, loss: float) -> dict[str, float]:
        """Clip, then AdamW step with the schedule's LR, or skip a non-finite step (``noria.train.step_guard``)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip is not None else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        return {"loss": loss, "grad_norm": grad_norm, **step_or_skip(self, finite)}

    # ------------------------------------------------------------------------------------ weights out

    def named_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights in ``dtype`` with the DiT's own names (LoRA merged in)."""
        from noria.train.lora import lora_scaling, merge_lora

        raw = ((n, p.detach()) for n, p in self.model.state_dict().items())
        if self.cfg.lora.enabled:
            return merge_lora(raw, lora_scaling(self.cfg.lora), dtype)
        return ((n, t.to(dtype)) for n, t in raw)

    def state_dict_for_sync(self, bucket_bytes: int, cast: bool = True) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of (name, tensor in the compute dtype): every weight, or with ``train.lora.sync:
        adapter`` the adapters alone under the names an engine with the same adapters holds.
        Always cast (``cast`` is ignored)."""
        from noria.sync import bucketize

        if self.cfg.lora.enabled and self.cfg.lora.sync == "adapter":
            named = ((n, p.detach().to(self.dtype)) for n, p in self.model.named_parameters() if ".lora_" in n)
        else:
            named = self.named_weights(self.dtype)
        return bucketize(named, bucket_bytes)

    def export_hf(self, folder: str | Path) -> Path:
        """A diffusers folder of the policy in the compute dtype (adapters merged); the name is the
        trainer contract's (``noria.train.backend``), the folder is diffusers', not transformers'."""
        state = {n: t.cpu().contiguous() for n, t in self.named_weights(self.dtype)}
        return save_dit(self.model, folder, state)

    def save(self, folder: str | Path, extra: dict[str, Any] | None = None) -> Path:
        from noria.train.checkpoint import save_checkpoint

        state = {"step": self.optimizer_steps, "nonfinite_streak": self.nonfinite_streak, "extra": extra or {}}
        return save_checkpoint(folder, self.model, self.optimizer, state)

    def load(self, folder: str | Path) -> dict[str, Any]:
        from noria.train.checkpoint import load_checkpoint
        from noria.train.optim import lr_at, set_lr

        state = load_checkpoint(folder, self.model, self.optimizer)
        self.optimizer_steps, self.nonfinite_streak = int(state["step"]), int(state.get("nonfinite_streak", 0))
        set_lr(self.optimizer, lr_at(self.optimizer_steps, self.cfg.optim, self.total_steps))
        return dict(state.get("extra", {}))


def _with(cfg: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(cfg, **changes)
