"""``MegatronBackend``: the trainer backend contract on megatron-core (``train.backend: megatron``).

The loop, the RL step, the objectives registry and weight sync see the same calls as with FSDP2
(``noria.train.backend.TrainBackend``); what changes is underneath::

    init:  HF folder -> native model (fp32, CPU) -> noria.models.megatron.to_megatron -> this rank's
           TP / EP slice -> GPTModel (compute dtype, CUDA) -> megatron DDP -> megatron optimizer
           (fp32 masters + AdamW; distributed optimizer on request)
    step:  the same token-budget micro-batches dealt to data-parallel ranks, the same chunked
           logprob head and LossFn; backward into DDP's fp32 grad buffers -> grad sync over DP ->
           grad norm -> non-finite check on ALL ranks -> clip + step (or skip)
    out:   every TP / EP rank's part gathered -> noria.models.megatron.to_hf -> HF names in buckets
           (weight sync, no disk) or an HF folder (export_hf); checkpoints through
           megatron.core.dist_checkpointing inside Noria's committed-folder protocol

What is shared with ``FSDPBackend`` (subclassed for it): micro-batch planning, the per-micro-batch
loss and metric plumbing, the NaN guard and LR schedule (``noria.train.step_guard``), rank 0's
buckets and HF folder (``noria.train.weights_out``), frozen reference / teacher models (those
run as native models on the PyTorch path, outside Megatron, on every rank). The critic of PPO with
GAE also runs on the PyTorch path (``noria.train.critic``).

Refused at construction (``require_megatron``): CPU, no CUDA, megatron-core missing, pp > 1, cp > 1;
also deterministic mode (engine.deterministic: Megatron's kernels are not the engine's exact ones)
and model.impl hf; route replay of MoE batches (rollout.routing_replay) at the first such batch.
LoRA and train.compile are refused when the config is loaded (``MegatronConfig.check_train``).

Not guaranteed: bitwise equality with FSDP2 (bf16 parameters with fp32 masters vs bf16 autocast over
fp32 parameters; the logprobs agree to bf16 rounding); Megatron's MoE load-balancing loss
(``train.loss.router_aux_coef`` > 0) is its own (Switch-style) and reports no ``moe/...`` metrics.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from noria.config import TrainConfig
from noria.models import load_model
from noria.models.megatron import VOCAB_ROWS, expert_slice, expert_to_global, expert_to_local, split_dim, tp_gather, to_hf, to_megatron
from noria.train.backend import LossFn, TrainError
from noria.train.checkpoint import load_checkpoint, save_checkpoint
from noria.train.fsdp import FSDPBackend
from noria.train.logprobs import token_logprobs
from noria.train.megatron.model import build_gpt, head_logits, init_parallel, load_weights, packed_hidden, quiet_import, require_megatron
from noria.train.optim import lr_at, set_lr
from noria.train.packed_forward import LogprobModel, wanted_sources
from noria.train.weights_out import decoder_holding, export_hf, rank0_buckets

class MegatronLogprobModel(nn.Module):
    """GPTModel plus the chunked logprob head: the same call as ``noria.train.packed_forward.LogprobModel``."""

    def __init__(self, gpt: nn.Module, vocab: int, chunk_tokens: int, temperature: float) -> None:
        super().__init__()
        self.lm = gpt
        self.vocab = vocab
        self.chunk_tokens = chunk_tokens
        self.temperature = temperature

    def forward(self, input_ids, positions, cu_seqlens, with_entropy=False, parents=None, want=None, routing=None):
        if parents is not None or routing is not None:
            raise TrainError("the Megatron backend runs neither shared-prefix (prefix-tree) batches nor replayed MoE routes")
        hidden = packed_hidden(self.lm, input_ids, cu_seqlens)
        pairs = None if want is None else wanted_sources(cu_seqlens, positions, None, want)
        return token_logprobs(hidden, self.head, input_ids, cu_seqlens, self.chunk_tokens, with_entropy,
                              self.temperature, pairs)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return head_logits(self.lm, hidden, self.vocab)


class MegatronOptimizer:
    """Megatron's optimizer and DDP grad buffers behind the three calls ``FSDPBackend`` makes
    (``zero_grad``, ``step``, ``param_groups`` for the LR)."""

    def __init__(self, opt, ddp) -> None:
        self.opt = opt
        self.ddp = ddp

    @property
    def param_groups(self) -> list[dict]:
        return self.opt.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad(set_to_none)

    def step(self) -> None:
        self.opt.step()  # copies grads to the fp32 masters, clips (optim.grad_clip), steps


class MegatronBackend(FSDPBackend):
    """``TrainBackend`` on megatron-core; see the module docstring."""

    def __init__(self, cfg: TrainConfig, loss_fn: LossFn | None = None, model_impl: str = "auto", seed: int = 0,
                 deterministic: bool = False, temperature: float = 1.0) -> None:
        require_megatron(cfg)
        if deterministic:
            raise TrainError("engine.deterministic needs train.backend single or fsdp2 (the engine's exact kernels)")
        if model_impl == "hf":
            raise TrainError("model.impl hf: the Megatron backend runs the native families (llama, qwen2, qwen3, qwen3_moe)")
        if not cfg.megatron.sequence_packing:  # one sequence per micro-batch: a budget every sequence exceeds
            cfg = dataclasses.replace(cfg, micro_batch_tokens=1)
        super().__init__(cfg, loss_fn, "native", seed, False, temperature)

    # ------------------------------------------------------------------------------------ init

    def init(self, model_path: str | Path, total_steps: int | None = None) -> None:
        """Load the HF folder into a GPTModel on this rank's GPU and build DDP and the optimizer."""
        from megatron.core import parallel_state as ps

        if self.loss_fn is None:
            from noria.train.losses import default_loss

            self.loss_fn = default_loss(self.cfg)
        quiet_import()
        init_parallel(self.cfg, self.seed)
        self.rank, self.world = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.global_rank, self.distributed = dist.get_rank(), dist.get_world_size() > 1
        self.reduce_group = ps.get_data_parallel_group()
        cuda = self.cfg.device.startswith("cuda")  # always, past require_megatron
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.model_path, self.total_steps = Path(model_path), total_steps
        torch.manual_seed(self.seed)
        native = load_model(model_path, dtype=torch.float32, device="cpu", impl="native")
        self.args, self.hf_config = native.args, native.hf_config
        gpt = build_gpt(self.args, self.cfg, self.compute_dtype)
        tp, tp_rank, experts = self._parallel()
        load_weights(gpt, to_megatron(native.state_dict(), self.args), self.args, tp, tp_rank, experts)
        del native
        self.skip_names: set[str] = set()
        self.lm = gpt
        self.policy = MegatronLogprobModel(gpt, self.args.vocab_size, self.cfg.logprob_chunk_tokens, self.temperature)
        self.optimizer = self._build_optimizer(gpt)
        set_lr(self.optimizer, lr_at(self.optimizer_steps, self.cfg.optim, total_steps))
        self.frozen = self._frozen_models(model_path)

    def _build_optimizer(self, gpt: nn.Module) -> MegatronOptimizer:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        m, o = self.cfg.megatron, self.cfg.optim
        ddp = DistributedDataParallel(
            config=gpt.config, module=gpt,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=m.distributed_optimizer),
        )
        bf16 = self.compute_dtype == torch.bfloat16
        ocfg = OptimizerConfig(
            optimizer="adam", lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0], adam_beta2=o.betas[1],
            adam_eps=o.eps, clip_grad=o.grad_clip or 0.0, bf16=bf16, params_dtype=self.compute_dtype,
            use_distributed_optimizer=m.distributed_optimizer,
        )
        self.ddp = ddp
        return MegatronOptimizer(get_megatron_optimizer(ocfg, [ddp]), ddp)

    def _parallel(self) -> tuple[int, int, range | None]:
        """(TP size, TP rank, the global experts this rank holds or None for a dense model)."""
        from megatron.core import parallel_state as ps

        moe = self.args.moe
        experts = None
        if moe is not None:
            experts = expert_slice(moe.num_experts, ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank())
        return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(), experts

    def _load_frozen(self, path: str | Path) -> nn.Module:
        # A native model on the PyTorch path, in the compute dtype, on the CPU between uses.
        lm = load_model(path, dtype=self.compute_dtype, device="cpu", impl="native")
        lm.requires_grad_(False)
        return LogprobModel(lm, self.cfg.logprob_chunk_tokens, False, self.temperature).eval()

    # ----------------------------------------------------------------------- forward / step

    def _autocast(self):
        import contextlib

        return contextlib.nullcontext()  # parameters are already in the compute dtype

    def _clip_grads(self) -> torch.Tensor:
        """Sync grads over data-parallel ranks, hand them to the fp32 masters, and return the global
        grad norm (over every rank); clipping happens in the optimizer's step."""
        self.ddp.finish_grad_sync()
        self.optimizer.opt.prepare_grads()
        norm = self.optimizer.opt.get_grad_norm()
        return torch.tensor(float(norm if norm is not None else math.nan), device=self.device)

    # ------------------------------------------------------------------------ weights out

    def _full_megatron(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The unsharded Megatron tensor ``name`` from this rank's part (collective over TP / EP)."""
        from megatron.core import parallel_state as ps

        t = local.detach()
        expert = ".local_experts." in name
        tp_group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
        tp = dist.get_world_size(tp_group) if dist.is_initialized() and tp_group is not None else 1
        if tp > 1 and split_dim(name) is not None:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            t = tp_gather(name, parts)
        if name in VOCAB_ROWS:
            t = t[: self.args.vocab_size]
        return t

    def _megatron_state(self) -> Mapping[str, torch.Tensor]:
        """Unsharded Megatron tensors by name, gathered when asked for (every rank asks in the same order)."""
        return _GatheredState(self)

    def _full_tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        return ((name, t.to(dtype)) for name, t in to_hf(self._megatron_state(), self.args))

    def state_dict_for_sync(self, bucket_bytes: int, cast: bool = True) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of (HF name, full tensor in the compute dtype, on this GPU); global rank 0 only,
        every rank runs the gathers. Always cast (``cast`` is ignored)."""
        yield from rank0_buckets(self._full_tensors(self.compute_dtype), bucket_bytes, self.global_rank == 0)

    def export_hf(self, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
        """Write an HF folder (weights in ``dtype``, default the compute dtype, plus tokenizer files)."""
        dtype = dtype or self.compute_dtype
        state = {name: t.cpu() for name, t in self._full_tensors(dtype)}
        materialize = functools.partial(decoder_holding, args=self.args, hf_config=self.hf_config, dtype=dtype)
        return export_hf(folder, state, materialize, self.model_path, self.global_rank == 0, self.distributed)

    # ------------------------------------------------------------------------ checkpoints

    def save(self, folder: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Committed checkpoint: model and optimizer through megatron's dist_checkpointing, plus RNG,
        optimizer steps and ``extra`` (Noria's layout and COMMITTED marker)."""
        state = {"optimizer_steps": self.optimizer_steps, "nonfinite_streak": self.nonfinite_streak,
                 "world_size": dist.get_world_size(), "backend": "megatron", "extra": extra or {}}
        return save_checkpoint(folder, self.policy, self.optimizer, state, write=self._write_dist)

    def load(self, folder: str | Path) -> dict[str, Any]:
        """Restore a committed checkpoint written by ``save``; returns its ``extra``."""
        state = load_checkpoint(folder, self.policy, self.optimizer, read=self._read_dist)
        if state.get("backend") != "megatron":
            raise TrainError(f"{folder}: not a Megatron-backend checkpoint (backend {state.get('backend', 'single/fsdp2')!r})")
        self.optimizer_steps = int(state["optimizer_steps"])
        self.nonfinite_streak = int(state.get("nonfinite_streak", 0))
        set_lr(self.optimizer, lr_at(self.optimizer_steps, self.cfg.optim, self.total_steps))
        return dict(state.get("extra", {}))

    def _sharded(self, loading: bool) -> dict[str, Any]:
        model = self.lm.sharded_state_dict()
        return {"model": model, "optimizer": self.optimizer.opt.sharded_state_dict(model, is_loading=loading)}

    def _write_dist(self, tmp: Path) -> None:
        from megatron.core import dist_checkpointing

        target = tmp / "megatron"
        if self.global_rank == 0:
            target.mkdir()
        if self.distributed:
            dist.barrier()
        dist_checkpointing.save(self._sharded(False), str(target))

    def _read_dist(self, folder: Path) -> None:
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(self._sharded(True), str(folder / "megatron"))
        self.lm.load_state_dict(loaded["model"])
        self.optimizer.opt.load_state_dict(loaded["optimizer"])


class _GatheredState(Mapping):
    """The unsharded Megatron state dict, each tensor gathered from the TP / EP ranks when read."""

    def __init__(self, backend: MegatronBackend) -> None:
        self.backend = backend
        self.params = dict(backend.lm.named_parameters())
        self.experts = backend._parallel()[2]
        first = 0 if self.experts is None else self.experts.start
        self.names = [expert_to_global(n, first) for n in self.params]

    def __getitem__(self, name: str) -> torch.Tensor:
        if self.experts is None or ".local_experts." not in name:
            return self.backend._full_megatron(name, self.params[name])
        return self._expert(name)

    def _expert(self, name: str) -> torch.Tensor:
        # Expert e lives on expert-parallel rank e // per: it broadcasts its (TP-gathered) tensor.
        from megatron.core import parallel_state as ps

        per = len(self.experts)
        e = int(name.split(".local_experts.")[1].split(".")[0])
        owner = e // per
        local = expert_to_local(name, range(owner * per, (owner + 1) * per))
        mine = self.params[local] if owner == ps.get_expert_model_parallel_rank() else None
        group = ps.get_expert_model_parallel_group()
        if dist.get_world_size(group) == 1:
            return self.backend._full_megatron(name, mine)
        template = self.params[local]
        t = self.backend._full_megatron(name, mine if mine is not None else template)
        t = t.contiguous() if mine is not None else torch.empty_like(t)
        dist.broadcast(t, src=dist.get_global_rank(group, owner), group=group)
        return t

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name) -> bool:
        return True  # to_hf asks only for names the model's arguments imply

