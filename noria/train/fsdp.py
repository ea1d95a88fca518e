"""The PyTorch trainer backend: one process (``backend: single``) or FSDP2 (``backend: fsdp2``).

How a step runs (``train_step``)::

    TrainBatch (same on every rank)
      -> plan_for_rank: token-budget micro-batches, dealt out to ranks, counts padded to equal
      -> per micro-batch: packed forward (PackedContext; noria.train.packed_forward) -> hidden [n, H]
         -> chunked logprobs (noria.train.logprobs) -> LossFn(LossInputs) -> backward
         -> (sum, weight) metrics (noria.train.step_metrics)
      -> clip the global grad norm -> non-finite check on ALL ranks -> AdamW step (or skip:
         noria.train.step_guard)

Precision. Master weights and AdamW state are fp32 on both paths. With FSDP2 the bf16 compute
copy comes from ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: each layer's
weights are all-gathered in bf16 and gradients reduce-scattered in fp32. The single-process path
keeps fp32 parameters and runs the forward under ``torch.autocast(bf16)``: no second copy of the
weights to keep in step, matmuls in bf16, and autocast's fp32 ops (softmax, norms' reductions)
in fp32. The two are therefore close but not bitwise equal in bf16; in fp32 (``param_dtype:
float32``) they agree to fp32 rounding.

Prefix trees (``train.share_prefix``, on by default): ``noria.train.prefix_tree.share_prefixes``
packs the batch's sequences as token tries, so a token several sequences share (a group's prompt,
a common start of their responses, earlier turns, the chat template's system message) goes through
forward and backward once, attending to exactly what it saw in each sequence. Logprobs come back
per original token, and each micro-batch's loss is computed on the original sequences its trees
hold (``TreeParts``): every sequence keeps its own advantages, rollout and old logprobs, and the
gradients of a shared token's loss terms add up. The losses and gradients are those of the plain
packing (up to rounding order). Only trained tokens (``loss_mask`` > 0) go through the LM head in
``train_step``.

Gradient accumulation. Each micro-batch's loss is already divided by the step-wide counts
(``LossInputs.total_tokens`` / ``total_seqs``), so the accumulated gradient is the full-batch
gradient whatever the split. FSDP2 averages gradients over ranks; the loss is multiplied by the
world size to turn that average back into the sum each rank's share needs.

Distributed. ``backend: fsdp2`` expects ``torch.distributed`` to be initialised by the launcher
(``init_distributed`` reads torchrun's environment): gloo on CPU, NCCL on CUDA. Each decoder
layer is its own FSDP unit and the root (embeddings, final norm, head, and the logprob head
around them) another. Every rank must make the same calls with the same batch.

Reference model (``loss.kl_coef > 0``): a frozen copy in the compute dtype, sharded like the
policy under FSDP2; on CUDA it waits on the CPU and visits the GPU only for
``compute_logprobs(which="reference")``. A teacher (``train.teacher``) is handled the same way.

MoE (``noria.train.moe``): with ``TrainBatch.routed_experts`` every forward replays the engine's
routes (``replay_routes``) or measures against them (``moe/route_mismatch``), and
``train.loss.router_aux_coef`` adds the routers' load-balancing loss.

LoRA (``train.lora.enabled``): peft adapters are injected before sharding; base weights are
frozen inside the same FSDP units and only adapters reach AdamW (``noria.train.lora``).

Deterministic mode (``FSDPBackend(deterministic=True)``; the loop passes ``engine.deterministic``):
the forward computes what the engine's deterministic runner computes, bit for bit (bf16 or fp32 on
CPU — AVX-512 and AVX2 alike —, bf16 on CUDA with Triton; native models, no LoRA): the model in exact
numerics (``DecoderLM.set_exact_numerics``: pure compute dtype from casts of the fp32 masters
instead of autocast, linear layers as matmuls of exactly ``DETERMINISTIC_ROWS`` rows) and attention through ``exact_attention`` (``PackedContext(deterministic=True)``).
So at step 0 the recomputed logprobs equal the engine's rollout logprobs exactly (temperature 1)
and ``rollout_kl`` is 0. The backward is the usual arithmetic (SDPA's attention gradient, one
matmul per linear gradient). Slower than the default forward, which it leaves unchanged.

Not guaranteed: bitwise equality between world sizes (reductions change order); CPU offload of
the policy (FSDP2's ``CPUOffloadPolicy`` needs an accelerator).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from noria import hardware
from noria.config import TrainConfig, ensure_valid
from noria.models import DecoderLM, load_model
from noria.models.quantize import set_fake_quant
from noria.train.backend import LossFn, LossInputs, TokenLogprobs, TrainError, Which, step_totals
from noria.train.checkpoint import load_checkpoint, save_checkpoint
from noria.train.freeze import freeze_parts
from noria.train.lora import adapter_tensors, apply_lora, load_adapter, lora_scaling, merge_lora, save_adapter
from noria.train.moe import aux_loss_term, micro_batch_routing, route_metrics
from noria.train.optim import build_optimizer, lr_at, set_lr
from noria.train.packed_forward import LogprobModel
from noria.train.packing import batch_to, plan_for_rank, seq_index, slice_batch
from noria.train.prefix_tree import TreeParts, share_prefixes
from noria.train.step_guard import step_or_skip
from noria.train.step_metrics import accumulate_metrics, all_reduce_metrics, averaged
from noria.train.weights_out import decoder_holding, export_hf, rank0_buckets
from noria.types import TrainBatch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def init_distributed(device: str = "cpu") -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's env (RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    gloo on CPU, NCCL on CUDA (each rank on ``cuda:LOCAL_RANK``). Returns (rank, world size).
    """
    if not dist.is_initialized():
        if device.startswith("cuda"):
            local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        else:
            dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def shutdown_distributed(clean: bool = True) -> None:
    """Tear the process group down (no-op when none is up).

    A clean exit first waits for every rank, so no peer is still sending when the group goes, then
    collects the modules and DTensors that still hold it. ``clean=False`` (a rank that failed)
    skips the barrier a dead peer would hang. A process spawned as a rank should then leave through
    ``rank_process``, which also skips Python's finalization (see there why).
    """
    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
    dist.destroy_process_group()
    gc.collect()


def rank_process(rank: int, fn: Any, *args: Any) -> None:
    """A spawned rank's whole life (the target for ``torch.multiprocessing.spawn`` and
    ``multiprocessing.Process``): ``fn(rank, *args)``, the process group torn down, then exit.

    The exit skips Python's finalization (``os._exit(0)`` after flushing stdout and stderr): gloo's
    worker threads drop a finished collective's tensors a moment after ``wait()`` returns, and one
    that does so while the interpreter finalizes ends its thread inside a destructor, which aborts
    the process ("terminate called without an active exception", SIGABRT; about one 2-rank run in
    five here, traced with gdb to ``AsyncAllgatherWork``'s destructor in ``ProcessGroupGloo::runLoop``).
    A rank that raised tears down without the barrier and raises, so its parent reports the error.
    """
    try:
        fn(rank, *args)
    except BaseException:
        shutdown_distributed(clean=False)
        raise
    shutdown_distributed()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def decoder_layers(lm: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a causal LM (native or transformers), the FSDP / checkpointing unit."""
    inner = getattr(lm, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TrainError(f"cannot find decoder layers (model.layers) in {type(lm).__name__}")
    return list(layers)


def checkpoint_layer(layer: nn.Module) -> None:
    """Recompute ``layer``'s activations in backward (names and FSDP hooks stay as they are)."""
    inner = layer.forward

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    layer.forward = forward


def compile_layer(layer: nn.Module) -> None:
    """``torch.compile`` the layer's forward in place (names and FSDP hooks stay as they are).
    Inductor fuses the elementwise work around the matmuls; the attention contexts' ``attend`` is
    not traced (``keep_packing_out_of_compile``: it loops over the packed sequences), so a new packing
    costs no recompile, only a new total length (dynamic after the second)."""
    import torch._dynamo

    from noria.models.attention import keep_packing_out_of_compile

    keep_packing_out_of_compile()
    # One graph per (layer code, shape kind): raise the limit so 100+ layers never fall back to eager.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    layer.forward = torch.compile(layer.forward)


def tied_duplicates(model: nn.Module) -> set[str]:
    """State-dict names that repeat an earlier parameter (a tied head): HF files omit them."""
    seen, dup = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        (dup.add(name) if id(p) in seen else seen.add(id(p)))
    return dup


class FSDPBackend:
    """``TrainBackend`` on PyTorch: single process or FSDP2; see the module docstring."""

    def __init__(
        self,
        cfg: TrainConfig,
        loss_fn: LossFn | None = None,
        model_impl: str = "auto",
        seed: int = 0,
        deterministic: bool = False,
        temperature: float = 1.0,
    ) -> None:
        """``deterministic``: compute exactly what the engine's deterministic mode computes (see the
        module docstring); pass ``engine.deterministic``. Slower; the default path is unchanged.
        ``temperature``: logprobs are ``log_softmax(logits / temperature)``, the distribution the
        engine sampled from (pass ``rollout.temperature``; the engine reports logprobs the same way)."""
        if not temperature > 0:
            raise TrainError(f"temperature must be > 0, got {temperature}")
        ensure_valid(cfg)  # once: a loaded config was validated when loaded
        if deterministic and cfg.lora.enabled:
            raise TrainError(
                "deterministic mode (engine.deterministic) with train.lora: engines get merged weights, and "
                "base + adapter in the trainer cannot match them bit for bit; turn one of them off"
            )
        self.cfg = cfg
        self.deterministic = deterministic
        self.temperature = float(temperature)
        self.loss_fn = loss_fn
        self.model_impl = model_impl
        self.seed = seed
        self.compute_dtype = DTYPES[hardware.resolve_dtype(cfg.param_dtype, cfg.device)]
        self.distributed = cfg.backend == "fsdp2"
        self.optimizer_steps = 0
        """Optimizer steps applied so far (skipped non-finite steps do not count); only the backend
        changes it. Not the weight version the engines serve (the loop's count of syncs)."""
        self.nonfinite_streak = 0
        self.reduce_group = None
        """Group over which per-token results and metrics are summed (None: all ranks; the Megatron
        backend sets its data-parallel group, since tensor-parallel ranks hold the same tokens)."""

    # ------------------------------------------------------------------------------------ init

    def init(self, model_path: str | Path, total_steps: int | None = None) -> None:
        """Load the policy in fp32, shard or place it, and build AdamW; reference/teacher if configured."""
        if self.loss_fn is None:
            from noria.train.losses import default_loss

            self.loss_fn = default_loss(self.cfg)
        self.rank, self.world = self._setup_dist()
        self.device = self._device()
        self.model_path = Path(model_path)
        self.total_steps = total_steps
        torch.manual_seed(self.seed)
        lm = load_model(model_path, dtype=torch.float32, device="cpu", impl=self.model_impl)
        if self.cfg.lora.enabled:
            lm = apply_lora(lm, self.cfg.lora)
            if self.cfg.lora.adapter_path:
                load_adapter(lm, self.cfg.lora.adapter_path, self.cfg.lora)
        freeze_parts(lm, self.cfg.freeze)  # train.freeze: a vision-language model's tower or connector
        if self.cfg.qat != "none" and not set_fake_quant(lm, self.cfg.qat, self.compute_dtype):  # as the integer engine serves
            raise TrainError(f"train.qat {self.cfg.qat}: the model has no native decoder layers to quantize (model.impl: native)")
        self.skip_names = tied_duplicates(lm)
        self.lm = lm
        self.policy = self._wrap(lm, train=True)
        self.optimizer = build_optimizer(self.policy.parameters(), self.cfg.optim)
        set_lr(self.optimizer, lr_at(self.optimizer_steps, self.cfg.optim, total_steps))
        self.frozen = self._frozen_models(model_path)

    def _setup_dist(self) -> tuple[int, int]:
        if not self.distributed:
            return 0, 1
        if not dist.is_initialized():
            raise TrainError(
                "train.backend fsdp2 needs torch.distributed initialised first "
                "(noria.train.fsdp.init_distributed, e.g. under torchrun)"
            )
        world = dist.get_world_size()
        if world != self.cfg.world_size:
            raise TrainError(f"train.world_size is {self.cfg.world_size} but the process group has {world} ranks")
        return dist.get_rank(), world

    def _device(self) -> torch.device:
        if self.cfg.device.startswith("cuda"):
            index = torch.cuda.current_device() if self.distributed else torch.device(self.cfg.device).index or 0
            return torch.device("cuda", index)
        return torch.device("cpu")

    def _head_model(self, lm: nn.Module) -> nn.Module:
        """The module ``_wrap`` shards and trains: the LM with its logprob head (the critic: a value head)."""
        return LogprobModel(lm, self.cfg.logprob_chunk_tokens, self.deterministic, self.temperature)

    def _wrap(self, lm: nn.Module, train: bool) -> nn.Module:
        model = self._head_model(lm)
        if self.deterministic and isinstance(lm, DecoderLM):
            lm.set_exact_numerics(self.compute_dtype)  # frozen models too: ref_kl is 0 at step 0
        elif self.deterministic and train:
            raise TrainError(f"deterministic mode runs the native models (llama, qwen2, qwen3, qwen3_moe), not {type(lm).__name__}")
        if train and self.cfg.compile and not self.deterministic:
            for layer in decoder_layers(lm):
                compile_layer(layer)
        if train and self.cfg.activation_checkpointing:
            for layer in decoder_layers(lm):
                checkpoint_layer(layer)
        if not self.distributed:
            return model.to(self.device)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world,))
        mp = MixedPrecisionPolicy()
        if train and self.compute_dtype != torch.float32:
            mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        for layer in decoder_layers(lm):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model

    def _frozen_models(self, model_path: str | Path) -> dict[str, nn.Module]:
        """The reference (RL with ``loss.kl_coef`` > 0) and the teacher (``train.teacher``) when configured."""
        frozen: dict[str, nn.Module] = {}
        if self.cfg.loss.kl_coef > 0 and self.cfg.algorithm == "rl":
            frozen["reference"] = self._load_frozen(model_path)
        if self.cfg.teacher:
            frozen["teacher"] = self._load_frozen(self.cfg.teacher)
        return frozen

    def _load_frozen(self, path: str | Path) -> nn.Module:
        lm = load_model(path, dtype=self.compute_dtype, device="cpu", impl=self.model_impl)
        lm.requires_grad_(False)
        model = self._wrap(lm, train=False).eval()
        return model.to("cpu") if self.device.type == "cuda" else model

    # ----------------------------------------------------------------------------- forward

    def _autocast(self):
        if self.distributed or self.deterministic or self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        # No cast cache: it holds a bf16 copy of every weight until the forward ends (0.27 GB of
        # SmolLM2-135M at the step's peak), and with activation checkpointing no cast is reused
        # anyway (each layer is cast again when recomputed). Off with checkpointing or without, so
        # both give the same step: with the cache, the gradient of a weight used several times in one
        # forward (the head over logprob chunks) was summed in bf16 before its cast back, without it
        # in fp32 (the grad norm differed by 3e-5 relative).
        return torch.autocast(self.device.type, dtype=self.compute_dtype, cache_enabled=False)

    def _forward(self, model: nn.Module, mb: TrainBatch, with_entropy: bool, trained_only: bool = False, routing=None):
        d = self.device
        want = (mb.loss_mask > 0).to(d) if trained_only else None
        extra = {} if routing is None else {"routing": routing}  # heads of dense models (the critic's) take none
        if mb.pixel_values is not None:  # a vision-language model's images (noria.models.vlm)
            extra["pixel_values"] = mb.pixel_values.to(d)
        if mb.parents is not None:  # a prefix-tree batch (only heads that attend through trees get one)
            extra["parents"] = mb.parents
        with self._autocast():
            return model(mb.input_ids.to(d), mb.positions.to(d), mb.cu_seqlens.to(d), with_entropy, want=want, **extra)

    def _share(self, batch: TrainBatch, trained: bool = False) -> tuple[TrainBatch, torch.Tensor, torch.Tensor]:
        """``share_prefixes`` when ``train.share_prefix`` is on (the same losses, shared tokens computed
        once), trees capped at ``train.micro_batch_tokens`` and, with several ranks, at a rank's share
        of the batch's tokens (one tree is one rank's); ``trained``: trained tokens too (the
        caller then computes losses per original token, ``TreeParts``). Only the native decoder
        attends through a tree; the transformers wrapper (``model.impl: hf``) runs each packed
        sequence whole, so it gets them unshared, and so does a batch with images (each sequence's
        image tokens take its own images)."""
        if not self.cfg.share_prefix or not isinstance(self.lm, DecoderLM) or batch.pixel_values is not None:
            identity = torch.arange(batch.n_tokens)
            return batch, identity, identity
        cap = min(self.cfg.micro_batch_tokens, -(-batch.n_tokens // self.world))  # ranks get trees to share out
        return share_prefixes(batch, max_tokens=cap, trained=trained)

    @contextlib.contextmanager
    def _visiting(self, model: nn.Module):
        # A frozen model lives on the CPU and visits the accelerator only while it is used.
        if self.device.type != "cuda":
            yield model
            return
        model.to(self.device)
        try:
            yield model
        finally:
            model.to("cpu")

    @torch.no_grad()
    def compute_logprobs(
        self, batch: TrainBatch, which: Which = "current", with_entropy: bool = False, trained_only: bool = False
    ) -> TokenLogprobs:
        """Per-token logprobs [N] (fp32, on CPU) under the policy, reference or teacher; no grad.

        ``trained_only``: only tokens with ``loss_mask`` > 0 are computed (the others are 0), which
        skips most of the LM head's work on prompts."""
        if which == "current":
            ctx, model = contextlib.nullcontext(), self.policy.eval()  # no dropout (LoRA's) here
        elif which in self.frozen:
            model = self.frozen[which]
            ctx = self._visiting(model)
        else:
            why = "loss.kl_coef is 0" if which == "reference" else "train.teacher is not set"
            raise TrainError(f"compute_logprobs(which={which!r}): no {which} model is loaded ({why})")
        original, (batch, _keep, index) = batch, self._share(batch, trained=True)
        lp = torch.zeros(batch.n_tokens, dtype=torch.float32, device=self.device)
        ent = torch.zeros_like(lp) if with_entropy else None
        plan = plan_for_rank(batch, self.cfg.micro_batch_tokens, self.rank, self.world)
        with ctx:
            for (a, b), scale in zip(plan.ranges, plan.scales):
                mb = slice_batch(batch, a, b)
                moe = micro_batch_routing(getattr(model, "lm", self.lm), mb, self.device, False, which == "current")
                out_lp, out_ent = self._forward(model, mb, with_entropy, trained_only, moe and moe.routing)
                if scale == 0:  # padding micro-batch: run for the collectives, keep nothing
                    continue
                lo, hi = int(batch.cu_seqlens[a]), int(batch.cu_seqlens[b])
                lp[lo:hi] = out_lp
                if with_entropy:
                    ent[lo:hi] = out_ent
        if self.distributed:  # each token was computed on exactly one rank; others hold 0
            dist.all_reduce(lp, group=self.reduce_group)
            if with_entropy:
                dist.all_reduce(ent, group=self.reduce_group)
        if original is not batch:  # back to the caller's layout: each prefix copy gets its values
            lp, ent = lp[index.to(lp.device)], None if ent is None else ent[index.to(ent.device)]
        return TokenLogprobs(lp.cpu(), None if ent is None else ent.cpu())

    # -------------------------------------------------------------------------------- train

    def train_step(
        self, batch: TrainBatch, old_logprobs: torch.Tensor | None = None, ref_logprobs: torch.Tensor | None = None
    ) -> dict[str, float]:
        """One optimizer step over ``batch`` (see the module docstring); returns averaged metrics."""
        t0 = time.perf_counter()
        if ref_logprobs is None and "reference" in self.frozen:
            ref_logprobs = self.compute_logprobs(batch, "reference", trained_only=True).logprobs
        tree, _keep, index = self._share(batch, trained=True)
        parts = TreeParts(batch, tree, index)  # losses read the original sequences behind each micro-batch
        out = self._optimizer_step(tree, lambda *args: self._micro_step(*args, parts, old_logprobs, ref_logprobs), step_totals(batch))
        # as given: a shared token counts once per sequence that holds it
        out.update(tokens=float(batch.n_tokens), step_time_s=time.perf_counter() - t0)
        return out

    def _optimizer_step(self, batch: TrainBatch, micro_step, totals: tuple[float, int] | None = None) -> dict[str, float]:
        """Zero grads, ``micro_step(batch, a, b, total_tokens, total_seqs) -> (loss, metrics)`` and
        backward per micro-batch of this rank, clip, check finiteness on all ranks, step or skip.
        ``totals``: the step's (loss tokens, sequences), when ``batch`` is a tree of other sequences."""
        total_tokens, total_seqs = totals if totals is not None else step_totals(batch)
        self.policy.train()
        self.optimizer.zero_grad(set_to_none=True)
        plan = plan_for_rank(batch, self.cfg.micro_batch_tokens, self.rank, self.world)
        sums: dict[str, list[float]] = {}
        loss_sum = 0.0
        loss_ok = torch.ones((), device=self.device)
        for (a, b), scale in zip(plan.ranges, plan.scales):
            loss, metrics = micro_step(batch, a, b, total_tokens, total_seqs)
            loss_ok = loss_ok * torch.isfinite(loss.detach())
            (loss * (scale * self.world)).backward()
            if scale:  # a padding micro-batch only keeps the ranks' collectives in step
                loss_sum += float(loss.detach())
                accumulate_metrics(sums, metrics)
        # The step loss is the sum over micro-batches and ranks; the backend owns this key.
        sums["loss"] = [loss_sum, float(self.rank == 0)]
        grad_norm = self._clip_grads()
        finite = self._all_finite(loss_ok, grad_norm)
        out = self._reduce_metrics(sums)
        out.update({"grad_norm": float(grad_norm), **step_or_skip(self, finite, " on at least one rank")})
        out.update(tokens=float(batch.n_tokens), loss_tokens=total_tokens)
        return out

    def _micro_step(self, batch, a, b, total_tokens, total_seqs, parts: TreeParts, old_logprobs, ref_logprobs):
        mb = batch_to(slice_batch(batch, a, b), self.device)
        want_entropy = self.cfg.algorithm == "rl" and self.cfg.loss.entropy_coef > 0
        aux_coef = self.cfg.loss.router_aux_coef
        moe = micro_batch_routing(self.lm, mb, self.device, aux=aux_coef > 0)
        lp, ent = self._forward(self.policy, mb, want_entropy, trained_only=True, routing=moe and moe.routing)
        d = self.device
        own, rows, at = parts.part(a, b)  # the original sequences of these trees, per original token
        if at is not None:
            at = at.to(d)
            lp, ent = lp[at], None if ent is None else ent[at]
        own = batch_to(own, d)
        old = lp.detach() if old_logprobs is None else old_logprobs[rows].to(d)
        ref = None if ref_logprobs is None else ref_logprobs[rows].to(d)
        inputs = LossInputs(own, lp, old, ref, ent, seq_index(own).to(d), total_tokens, total_seqs)
        loss, metrics = self.loss_fn(inputs)
        if moe is not None:
            metrics = {**metrics, **route_metrics(moe)}
            if aux_coef > 0:
                term, aux_metrics = aux_loss_term(moe, aux_coef, mb.n_tokens, batch.n_tokens)
                loss, metrics = loss + term, {**metrics, **aux_metrics}
        return loss, metrics

    def _clip_grads(self) -> torch.Tensor:
        params = [p for p in self.policy.parameters() if p.grad is not None]
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def _all_finite(self, loss_ok: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        bad = (1 - loss_ok) + (~torch.isfinite(grad_norm)).float()
        bad = bad.float().reshape(1)
        if self.distributed:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bool(bad.item() == 0)

    def _reduce_metrics(self, sums: dict[str, list[float]]) -> dict[str, float]:
        if self.distributed:
            sums = all_reduce_metrics(sums, self.world, self.reduce_group, self.device)
        return averaged(sums)

    # ------------------------------------------------------------------------ weights out

    def _raw_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        # Collective under FSDP2 (one all-gather per tensor): every rank runs it to the end.
        for name, t in self.lm.state_dict().items():
            if name in self.skip_names:
                continue
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            yield name, t.detach()

    def _full_tensors(self, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights with HF names in ``dtype`` (LoRA adapters merged in; None: as kept, the
        merged ones in the compute dtype)."""
        if self.cfg.lora.enabled:
            return merge_lora(self._raw_tensors(), lora_scaling(self.cfg.lora), dtype or self.compute_dtype)
        if dtype is None:
            return self._raw_tensors()
        return ((name, t.to(dtype)) for name, t in self._raw_tensors())

    def state_dict_for_sync(self, bucket_bytes: int, cast: bool = True) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of (HF name, full tensor in the compute dtype, on the trainer device); rank 0 only.
        ``cast=False``: in the dtype the trainer keeps them (the fp32 masters; no cast copy), for a
        sync that casts as it writes.

        With LoRA, ``train.lora.sync`` picks merged weights (HF names) or the adapters alone
        (peft names).
        """
        if self.cfg.lora.enabled and self.cfg.lora.sync == "adapter":
            tensors = adapter_tensors(self._raw_tensors(), self.compute_dtype)
        else:
            tensors = self._full_tensors(self.compute_dtype if cast else None)
        yield from rank0_buckets(tensors, bucket_bytes, self.rank == 0)

    def export_hf(self, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
        """Write an HF folder (weights in ``dtype``, default the compute dtype, plus tokenizer files);
        with LoRA also the adapters alone, unmerged, in ``adapter/``."""
        dtype = dtype or self.compute_dtype
        state = {name: t.cpu() for name, t in self._full_tensors(dtype)}
        raw = list(self._raw_tensors()) if self.cfg.lora.enabled else []

        def adapter(folder: Path) -> None:
            save_adapter(iter(raw), self.cfg.lora, folder / "adapter", str(self.model_path))

        materialize = functools.partial(self._materialize, dtype=dtype)
        return export_hf(folder, state, materialize, self.model_path, self.rank == 0, self.distributed, adapter if raw else None)

    def _materialize(self, state: dict[str, torch.Tensor], dtype: torch.dtype) -> nn.Module:
        # An unsharded CPU model holding ``state``, for save_model (which knows both model kinds).
        if isinstance(self.lm, DecoderLM):
            return decoder_holding(state, self.lm.args, self.lm.hf_config, dtype)
        model = load_model(self.model_path, dtype=dtype, device="cpu", impl=self.model_impl)
        model.load_state_dict(state, strict=False)
        return model

    # ------------------------------------------------------------------------ checkpoints

    def save(self, folder: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Committed DCP checkpoint of policy, optimizer, RNG, optimizer steps and ``extra``."""
        state = {
            "optimizer_steps": self.optimizer_steps,
            "nonfinite_streak": self.nonfinite_streak,
            "world_size": self.world,
            "extra": extra or {},
        }
        return save_checkpoint(folder, self.policy, self.optimizer, state)

    def load(self, folder: str | Path) -> dict[str, Any]:
        """Restore a committed checkpoint written by ``save``; returns its ``extra``."""
        state = load_checkpoint(folder, self.policy, self.optimizer)
        # Checkpoints before the rename store the count as "step" (and a mirrored weight_version,
        # which the RL job's own "weight_version" supersedes).
        self.optimizer_steps = int(state["optimizer_steps"] if "optimizer_steps" in state else state["step"])
        self.nonfinite_streak = int(state.get("nonfinite_streak", 0))
        set_lr(self.optimizer, lr_at(self.optimizer_steps, self.cfg.optim, self.total_steps))
        return dict(state.get("extra", {}))
