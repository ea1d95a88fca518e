"""Any other HF causal LM behind the native decoder's interface (the day-0 path).

:class:`HFCausalLM` wraps a transformers ``AutoModelForCausalLM`` so trainers can call
``forward(input_ids, positions, attn)`` / ``hidden_states(...)`` / ``lm_head`` without knowing
which implementation they hold. The wrapper adopts the HF model's child modules as its own, so
``state_dict()`` names are exactly transformers' names, as with the native decoder; weight sync
and checkpoint export rely on that.

Attention contexts translate to transformers arguments:

- ``CausalContext``: plain call (optional ``position_ids``).
- ``PaddedContext``: ``attention_mask`` and ``position_ids``.
- ``PackedContext``: each packed sequence is run on its own and the outputs concatenated. That is
  exact for every architecture (transformers only honours packing through ``position_ids`` with
  some attention backends), at the cost of one call per sequence.
- Any other context (e.g. the engine's paged cache) raises ``NotImplementedError``: its KV-cache
  logic lives in the context, which transformers cannot call.

Not guaranteed: models whose logits are more than ``lm_head(final hidden)`` (logit soft-capping,
logit scales) give exact logits from ``forward`` but not from ``lm_head(hidden_states(...))``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from noria.models.attention import AttentionContext, CausalContext, PackedContext, PaddedContext
from noria.models.checkpoint import CheckpointMismatch


class HFCausalLM(nn.Module):
    """A transformers causal LM with the native ``forward`` / ``hidden_states`` interface."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        if list(hf_model.named_buffers(recurse=False)):
            raise NotImplementedError(
                f"{type(hf_model).__name__} has top-level buffers; cannot adopt it"
            )
        # Held outside the module tree so its parameters are not listed twice (under "hf.").
        object.__setattr__(self, "hf", hf_model)
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        for name, param in hf_model.named_parameters(recurse=False):
            self.register_parameter(name, param)
        self.hf_config = hf_model.config.to_dict()
        if "lm_head" not in self._modules:
            # The head has another name here (GPT-NeoX: embed_out); an alias outside the module
            # tree gives the uniform ``model.lm_head`` without a second state-dict entry.
            object.__setattr__(self, "lm_head", hf_model.get_output_embeddings())

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn: AttentionContext | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] for input_ids [B, T]."""
        return self._run(self.hf, input_ids, positions, attn, lambda out: out.logits)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn: AttentionContext | None = None,
    ) -> torch.Tensor:
        """Final normed hidden states [B, T, H] (the base model's ``last_hidden_state``)."""
        return self._run(
            self.hf.base_model, input_ids, positions, attn, lambda out: out.last_hidden_state
        )

    def _run(self, module, input_ids, positions, attn, pick) -> torch.Tensor:
        ctx = attn if attn is not None else CausalContext()
        if isinstance(ctx, PackedContext):
            return self._run_packed(module, input_ids, positions, ctx, pick)
        if isinstance(ctx, PaddedContext):
            if positions is None:
                positions = ctx.positions(*input_ids.shape, input_ids.device)
            mask = ctx.attention_mask.to(input_ids.device).long()
            return pick(
                module(
                    input_ids=input_ids,
                    attention_mask=mask,
                    position_ids=positions,
                    use_cache=False,
                )
            )
        if isinstance(ctx, CausalContext):
            return pick(module(input_ids=input_ids, position_ids=positions, use_cache=False))
        raise NotImplementedError(
            f"the transformers wrapper supports CausalContext, PaddedContext and PackedContext, "
            f"not {type(ctx).__name__}; use a native family for custom attention contexts"
        )

    def _run_packed(self, module, input_ids, positions, ctx: PackedContext, pick) -> torch.Tensor:
        if positions is None:
            positions = ctx.positions(*input_ids.shape, input_ids.device)
        ctx.check_shape(*input_ids.shape)
        outs, start = [], 0
        for n in ctx.seq_lens:
            end = start + n
            out = module(
                input_ids=input_ids[:, start:end],
                position_ids=positions[:, start:end],
                use_cache=False,
            )
            outs.append(pick(out))
            start = end
        return torch.cat(outs, dim=1)


def load_hf(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> HFCausalLM:
    """Load any transformers causal LM from a folder, as strict about tensors as the native path."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, output_loading_info=True
    )
    problems = {
        kind: sorted(map(str, info.get(kind) or ()))
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
    }
    problems = {kind: keys for kind, keys in problems.items() if keys}
    if problems:
        raise CheckpointMismatch(f"config/checkpoint mismatch in {path}: {problems}")
    return HFCausalLM(model.to(device)).eval()


def disable_dropout(model: nn.Module) -> int:
    """Set every ``nn.Dropout`` of ``model`` to p = 0 (as TRL's GRPO does by default): in RL the
    trainer's logprobs must come from the function the engine sampled from. Returns how many."""
    dropouts = [m for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0]
    for m in dropouts:
        m.p = 0.0
    for name in ("attention_dropout", "attn_dropout"):  # attention kernels read a float, not a module
        for m in model.modules():
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)
    return len(dropouts)
