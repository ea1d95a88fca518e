"""Per-token log-probabilities (and entropy) of packed sequences, from hidden states in chunks.

How data moves: the model gives final hidden states [N, H] for the packed tokens; the LM head is
applied ``chunk_tokens`` rows at a time, each chunk's [chunk, V] logits are turned into the
log-probability of the next token (and optionally the entropy of that distribution), and only
those [chunk] numbers are kept. With autograd on, each chunk runs under activation checkpointing,
so backward recomputes the chunk's logits instead of keeping N x V log-softmax outputs alive:
peak memory is one chunk of logits, whatever N is.

Alignment: ``logprobs[t] = log p(input_ids[t] | tokens before t in its sequence)``, computed from
the hidden state at ``t - 1``. The first token of each sequence gets 0 (and entropy 0); callers
mask it out (``TrainBatch.loss_mask`` is 0 there).

Logits and the softmax are computed in fp32 whatever the compute dtype (the head's matmul itself
runs in the compute dtype).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

Head = Callable[[torch.Tensor], torch.Tensor]


def predicted_positions(cu_seqlens: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """LongTensor: every position except the last of each sequence (its logits predict nothing here)."""
    keep = torch.ones(n_tokens, dtype=torch.bool, device=cu_seqlens.device)
    keep[(cu_seqlens[1:] - 1).long()] = False
    return keep.nonzero().squeeze(-1)


def token_logprobs(
    hidden: torch.Tensor,
    head: Head,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_tokens: int,
    with_entropy: bool = False,
    temperature: float = 1.0,
    pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each token given its prefix, fp32 [N]; entropy [N] too when asked (else None).

    ``temperature`` != 1 scores ``log_softmax(logits.float() / T)`` (T as an fp32 tensor, the
    engine's exact recipe), so rollout and trainer logprobs describe the same distribution.
    ``pairs = (src, dst)``: compute only tokens ``dst``, each from the hidden state at ``src`` (shared
    prefixes, or only the trained tokens; ``noria.train.packing.prediction_sources``); the others
    get 0. Default: every token from the one before it in its sequence.
    """
    temp = None if temperature == 1.0 else torch.tensor(temperature, dtype=torch.float32, device=hidden.device)
    n = input_ids.numel()
    if pairs is None:
        src = predicted_positions(cu_seqlens.to(input_ids.device), n)
        dst = src + 1
    else:
        src, dst = (t.to(input_ids.device) for t in pairs)
    targets = input_ids[dst]
    lp_parts, ent_parts = [], []
    for lo in range(0, src.numel(), chunk_tokens):
        idx = src[lo : lo + chunk_tokens]
        h = hidden.index_select(0, idx)
        tgt = targets[lo : lo + chunk_tokens]
        if torch.is_grad_enabled() and hidden.requires_grad:
            lp, ent = checkpoint(_chunk, h, tgt, head, with_entropy, temp, use_reentrant=False)
        else:
            lp, ent = _chunk(h, tgt, head, with_entropy, temp)
        lp_parts.append(lp)
        ent_parts.append(ent)
    logprobs = _scatter(lp_parts, dst, n, hidden.device)
    entropy = _scatter(ent_parts, dst, n, hidden.device) if with_entropy else None
    return logprobs, entropy


def _chunk(h: torch.Tensor, tgt: torch.Tensor, head: Head, with_entropy: bool, temp: torch.Tensor | None = None):
    logits = head(h).float()
    logp = F.log_softmax(logits if temp is None else logits / temp, dim=-1)
    lp = logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1) if with_entropy else lp.new_zeros(0)
    return lp, ent


def _scatter(parts: list[torch.Tensor], dst: torch.Tensor, n: int, device) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.float32, device=device)
    if not parts:  # every sequence has one token: nothing is predicted
        return out
    return out.index_copy(0, dst, torch.cat(parts))
