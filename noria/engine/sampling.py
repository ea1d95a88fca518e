"""Sampling of one token per row from a batch of logits, each row with its own settings.

Input: logits ``[S, V]`` (any float dtype; everything here runs in fp32), one ``SamplingParams`` per
row, and per row an optional ``torch.Generator``. Output (:class:`SampleResult`): the chosen ids,
their logprobs and, on request, the top-k logprobs of each row.

Logprobs are ``log_softmax(logits / T)`` (``log_softmax(logits)`` when greedy), taken before top-p,
top-k and min-p truncation: that is the distribution a trainer recomputes at the same temperature
(see ``GenerateOutput.logprobs``).

Randomness. A row is sampled with the exponential-race trick (argmax of ``p / E`` with
``E ~ Exp(1)``), which equals a draw from ``p``. Rows with a generator of their own draw their
noise from it alone, so a seeded request's samples do not depend on what else is in the batch;
unseeded rows share the engine's generator and do depend on batch order.

Blocking: none; pure tensor code on the logits' device (no host sync; callers read the results).
Not guaranteed: ties in argmax break toward the lower id, as torch does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from noria.engine.protocol import SamplingParams


@dataclass
class SampleResult:
    """Per row: the sampled id, its logprob, and the top-k ids/logprobs (k = the largest asked)."""

    token_ids: torch.Tensor
    """int64 [S]."""
    logprobs: torch.Tensor
    """fp32 [S]."""
    top_ids: torch.Tensor | None = None
    """int64 [S, K] where K = max top_logprobs_num of the batch; None when no row asked."""
    top_logprobs: torch.Tensor | None = None
    """fp32 [S, K]."""


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None,
    top_logprobs_num: int = 0,
) -> SampleResult:
    """Sample one token per row; see the module docstring."""
    logits = logits.float()
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    # x / 1.0 == x bitwise: skip a full pass over [S, V] when no row has a temperature (greedy).
    scaled = logits if all(t == 1.0 for t in temps) else logits / torch.tensor(temps, device=logits.device).unsqueeze(1)
    logprobs = torch.log_softmax(scaled, dim=-1)
    token_ids = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        probs = _truncate(logprobs[rows].exp(), [params[i] for i in sampled_rows])
        noise = _exponential_noise(probs, [generators[i] for i in sampled_rows], default_generator)
        token_ids = token_ids.index_copy(0, rows, (probs / noise).argmax(dim=-1))
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    result = SampleResult(token_ids=token_ids, logprobs=chosen)
    if top_logprobs_num > 0:
        top = logprobs.topk(min(top_logprobs_num, logprobs.shape[1]), dim=-1)
        result.top_ids, result.top_logprobs = top.indices, top.values
    return result


def _truncate(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero out tokens removed by top-k, top-p and min-p (rows keep at least their best token)."""
    if all(p.top_k == -1 and p.top_p >= 1.0 and p.min_p <= 0.0 for p in params):
        return probs
    device, vocab = probs.device, probs.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([float(p.top_p) for p in params], device=device)
    min_p = torch.tensor([float(p.min_p) for p in params], device=device)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    remove = ranks >= top_k.unsqueeze(1)
    # Keep a token while the mass strictly before it is below top_p: the smallest set reaching top_p.
    remove |= (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p.unsqueeze(1)
    remove |= sorted_p < min_p.unsqueeze(1) * sorted_p[:, :1]
    remove[:, 0] = False
    sorted_p = sorted_p.masked_fill(remove, 0.0)
    return torch.zeros_like(probs).scatter(1, order, sorted_p)


def _exponential_noise(
    probs: torch.Tensor, generators: list[torch.Generator | None], default: torch.Generator | None
) -> torch.Tensor:
    noise = torch.empty_like(probs)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        idx = torch.tensor(shared, device=probs.device)
        draws = torch.empty(len(shared), probs.shape[1], device=probs.device)
        noise.index_copy_(0, idx, draws.exponential_(generator=default))
    for i, gen in enumerate(generators):
        if gen is not None:
            noise[i].exponential_(generator=gen)
    # exponential_ can return exactly 0 in fp32; 0 would make p/0 = inf win regardless of p.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)
