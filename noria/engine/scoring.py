"""Prefill scoring: the log-probabilities of a request's own input tokens (``logprob_start_len``).

What it owns: which rows of a step are scored (``score_rows``), turning their logits into logprobs
and top-k (``score``, the same ``log_softmax`` at the request's temperature as sampled tokens, so
a teacher engine and a trainer agree bit for bit in deterministic mode), and recording each input
position on its request exactly once (``record``: a retraction's re-prefill computes a position
again and is ignored). The scheduler keeps the prefix cache from covering a position that still
needs scoring (``Req.scoring_from``), so every scored position is computed by this request.

The logit at position q predicts input token q + 1; the last input position predicts the first
output token, which is sampled, not scored. SGLang's API: ``return_logprob``,
``logprob_start_len``, ``top_logprobs_num``; the answer's ``meta_info.input_token_logprobs`` has
one ``[logprob, token_id, text]`` per input token from ``logprob_start_len`` on (logprob None at
position 0), ``input_top_logprobs`` likewise.

Not guaranteed: scoring with routed-expert capture (refused at submit); a request scored in
CUDA graphs (prefill never runs in one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from noria.engine.sampling import log_softmax_rows


@dataclass
class ScoreRow:
    """One scored row of a step: the chunk, its row in the flattened step, and the position q
    whose logits predict input token q + 1."""

    chunk: int
    row: int
    position: int


def score_rows(chunks: list[Any]) -> list[ScoreRow]:
    """The rows of a step whose logits score input tokens not scored yet."""
    rows, offset = [], 0
    for i, c in enumerate(chunks):
        first = c.req.scoring_from
        if first is not None and not c.pending:
            for q in range(max(c.start, first), min(c.start + c.n, c.req.prompt_len - 1)):
                rows.append(ScoreRow(i, offset + q - c.start, q))
        offset += c.n
    return rows


def score(logits: torch.Tensor, chunks: list[Any], rows: list[ScoreRow]) -> list[tuple[Any, int, float, list | None]]:
    """(request, position, logprob of input token position + 1, its top-k or None) per row."""
    reqs = [chunks[r.chunk].req for r in rows]
    logp = log_softmax_rows(logits, [req.request.sampling for req in reqs])
    targets = torch.tensor([req.all_ids[r.position + 1] for req, r in zip(reqs, rows)], device=logp.device)
    chosen = logp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    k = max(req.request.top_logprobs_num for req in reqs)
    tops: list[list | None] = [None] * len(rows)
    if k > 0:
        top = logp.topk(min(k, logp.shape[1]), dim=-1)
        ids, values = top.indices.tolist(), top.values.tolist()
        tops = [list(zip(i, v))[: req.request.top_logprobs_num] or None for i, v, req in zip(ids, values, reqs)]
    return [(req, r.position, lp, t) for req, r, lp, t in zip(reqs, rows, chosen, tops)]


def record(scored: list[tuple[Any, int, float, list | None]]) -> None:
    """Append each result to its request, in position order; positions already held are skipped."""
    for req, q, lp, top in scored:
        if q != req.scoring_from:
            continue
        req.input_logprobs.append(lp)
        if req.input_top_logprobs is not None:
            req.input_top_logprobs.append(top)
