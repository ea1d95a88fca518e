"""The PyTorch path's forward of a packed batch, shared by the policy and frozen models of
``noria.train.fsdp``, the Megatron backend's frozen models and head, and the critic
(``noria.train.critic``).

How data moves::

    packed ids, positions, cu_seqlens (+ parents of a prefix-tree batch)
      -> packed_hidden: one PackedContext over the sequences -> final hidden states [N, H]
      -> wanted_sources: which hidden state predicts which token, restricted to the wanted ones
      -> token_logprobs (noria.train.logprobs): the LM head in chunks -> logprobs [N] (+ entropy)

``LogprobModel`` is the policy plus that head as one module, so that FSDP2's root forward hooks
cover the head too (``hidden_states`` and ``lm_head`` called separately would run outside them).
"""

from __future__ import annotations

import torch
from torch import nn

from noria.models import PackedContext
from noria.train.logprobs import token_logprobs
from noria.train.packing import prediction_sources
from noria.train.prefix_tree import packed_trees


class LogprobModel(nn.Module):
    """The policy plus its logprob head: packed ids -> per-token logprobs (and entropy)."""

    def __init__(self, lm: nn.Module, chunk_tokens: int, deterministic: bool = False, temperature: float = 1.0) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        self.deterministic = deterministic
        self.temperature = temperature

    def forward(
        self, input_ids, positions, cu_seqlens, with_entropy: bool = False, parents=None, want=None,
        routing=None, pixel_values=None,
    ):
        """``parents``: a prefix-tree batch's (``TrainBatch.parents``); ``want`` (bool [N]):
        compute only these tokens' logprobs (the LM head skips the rest, which get 0); ``routing``:
        MoE routes to replay and record (``noria.train.moe``); ``pixel_values``: a vision-language
        model's images, in the order of the batch's image tokens."""
        hidden = packed_hidden(
            self.lm, input_ids, positions, cu_seqlens, parents, self.deterministic, routing, pixel_values
        )
        pairs = None
        if parents is not None or want is not None:
            pairs = wanted_sources(cu_seqlens, positions, parents, want)
        return token_logprobs(
            hidden, self.lm.lm_head, input_ids, cu_seqlens, self.chunk_tokens, with_entropy, self.temperature, pairs
        )


def packed_hidden(
    lm: nn.Module, input_ids, positions, cu_seqlens, parents=None, deterministic=False, routing=None, pixel_values=None,
):
    """Final hidden states [N, H] of a packed batch (plain sequences or prefix trees)."""
    trees = packed_trees(cu_seqlens, parents)
    ctx = PackedContext(torch.diff(cu_seqlens).tolist(), deterministic=deterministic, trees=trees)
    extra = {} if routing is None else {"routing": routing}  # only MoE models take it
    if pixel_values is not None:  # only vision-language models take it
        extra["pixel_values"] = pixel_values
    return lm.hidden_states(input_ids[None], positions[None], ctx, **extra)[0]


def wanted_sources(cu_seqlens, positions, parents=None, want=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``prediction_sources`` restricted to the tokens ``want`` (bool [N]) marks, when given."""
    src, dst = prediction_sources(cu_seqlens, positions, parents)
    if want is not None:
        keep = want[dst]
        src, dst = src[keep], dst[keep]
    return src, dst
