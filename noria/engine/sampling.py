"""Sampling of one token per row from a batch of logits, each row with its own settings.

Input: logits ``[S, V]`` (any float dtype; everything here runs in fp32), one ``SamplingParams`` per
row, and per row an optional ``torch.Generator``. Output (:class:`SampleResult`): the chosen ids,
their logprobs and, on request, the top-k logprobs of each row.

Logprobs are ``log_softmax(logits / T)`` (``log_softmax(logits)`` when greedy), taken before top-p,
top-k and min-p truncation: that is the distribution a trainer recomputes at the same temperature
(see ``GenerateOutput.logprobs``).

How. On the CPU one fused C++ pass per row (``kernels/sampling.cpp``) computes the max, the
log-sum-exp, the token and its logprob, with no ``[S, V]`` temporaries; on CUDA with Triton the
same recipe is a Triton kernel (``noria.engine.cuda.fused.sample_rows``, also captured at the end
of decode graphs); elsewhere it runs in torch. Top-k/top-p/min-p rows (sort-based) and top-k logprobs go through torch, and only
when some row asks for them. Fused logprobs equal ``log_softmax`` to fp32 rounding (a different
summation order); ``exact_logprobs`` takes them from ``torch.log_softmax`` itself.

Randomness. A sampled row draws ONE uniform ``u`` and takes the inverse CDF: the first id whose
running probability mass exceeds ``u`` (vocabulary order). Rows with a generator of their own draw
``u`` from it alone, so a seeded request's samples do not depend on what else is in the batch;
unseeded rows share the engine's generator and do depend on batch order. (Before this, rows used
the exponential-race trick with V noise draws per row; a given seed now yields other tokens than
it did then. The C++ and torch paths can differ when ``u`` falls within rounding of a CDF boundary.)

Blocking: reads one float per seeded row from its generator; otherwise tensor code.
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
    exact_logprobs: bool = False,
) -> SampleResult:
    """Sample one token per row; see the module docstring.

    ``exact_logprobs``: take the chosen logprobs from ``torch.log_softmax`` (the trainer's op, bit
    for bit) instead of the fused kernel (equal to rounding); deterministic mode asks for it.
    """
    uniforms = draw_uniforms(params, generators, default_generator)
    temps = torch.tensor([0.0 if p.greedy else float(p.temperature) for p in params])
    fused = _fused_kernel(logits)
    if fused is not None:
        token_ids, chosen = fused.sample_rows(logits.contiguous(), temps, uniforms)
    elif _triton_sampler(logits):
        from noria.engine.cuda.fused import sample_rows

        out = sample_rows(logits.contiguous(), temps.to(logits.device), uniforms.to(logits.device))
        token_ids, chosen = out[0].long(), out[1].float()
    else:
        token_ids, chosen = _sample_torch(logits.float(), temps, uniforms)
    truncated = [i for i, p in enumerate(params) if not p.greedy and _truncates(p)]
    if truncated:
        rows = torch.tensor(truncated, device=logits.device)
        token_ids = token_ids.index_copy(0, rows, _sample_truncated(logits, params, truncated, uniforms))
    logprobs = None
    if exact_logprobs or top_logprobs_num > 0:
        logprobs = _log_softmax(logits, params)
    if exact_logprobs:
        chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    result = SampleResult(token_ids=token_ids, logprobs=chosen)
    if top_logprobs_num > 0:
        top = logprobs.topk(min(top_logprobs_num, logprobs.shape[1]), dim=-1)
        result.top_ids, result.top_logprobs = top.indices, top.values
    return result


def device_sampleable(params: list[SamplingParams], top_logprobs_num: int) -> bool:
    """Whether a CUDA graph's sampler (``noria.engine.cuda.fused.sample_rows``: greedy or plain
    temperature) draws these rows as :func:`sample` would: no top-k/top-p/min-p, no top logprobs
    (deterministic mode never samples in a graph)."""
    return top_logprobs_num == 0 and not any(not p.greedy and _truncates(p) for p in params)


def _triton_sampler(logits: torch.Tensor) -> bool:
    """CUDA logits and Triton present: the fused device sampler replaces the torch recipe."""
    if logits.device.type != "cuda":
        return False
    from noria.engine.cuda import triton_available

    return triton_available()


def _fused_kernel(logits: torch.Tensor):
    """The C++ sampler for CPU logits, or None (CUDA, no compiler): then the torch fallback runs."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16):
        return None
    try:
        from noria.engine import kernels
    except ImportError:
        return None
    return kernels.cpu_kernel() if kernels.fused_kernels_enabled() else None


def draw_uniforms(
    params: list[SamplingParams], generators: list[torch.Generator | None], default: torch.Generator | None
) -> torch.Tensor:
    """One U[0, 1) per row: from the row's own generator when seeded, else from the shared one.

    On CUDA (the shared generator's device) the draws stay on the device: no host sync per step."""
    device = _device(default)
    if device.type != "cuda":
        device = torch.device("cpu")
    u = torch.zeros(len(params), device=device)
    shared = [i for i, (p, g) in enumerate(zip(params, generators)) if not p.greedy and g is None]
    if shared:
        u[shared] = torch.rand(len(shared), generator=default, device=_device(default)).to(device)
    for i, (p, gen) in enumerate(zip(params, generators)):
        if not p.greedy and gen is not None:
            u[i : i + 1] = torch.rand(1, generator=gen, device=_device(gen)).to(device)
    return u


def _device(gen: torch.Generator | None) -> torch.device:
    return gen.device if gen is not None else torch.device("cpu")


def _scaled(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    logits = logits.float()
    temps = [1.0 if p.greedy else float(p.temperature) for p in params]
    # x / 1.0 == x bitwise: skip a full pass over [S, V] when no row has a temperature (greedy).
    if all(t == 1.0 for t in temps):
        return logits
    return logits / torch.tensor(temps, device=logits.device).unsqueeze(1)


def _log_softmax(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    return torch.log_softmax(_scaled(logits, params), dim=-1)


def log_softmax_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """fp32 [S, V]: each row's ``log_softmax(logits / T)`` (T of its params; greedy: T = 1), the
    op sampled tokens' exact logprobs come from (prefill scoring, ``noria.engine.scoring``)."""
    return _log_softmax(logits, params)


def processed_weights(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """fp32 [S, V]: each row's sampling distribution, unnormalised where top-k/top-p/min-p zero
    tokens out: ``softmax(logits / T)`` then truncation (``noria.engine.speculative`` accepts and
    resamples against it; greedy rows get T = 1 and are read by argmax, not from here)."""
    probs = torch.softmax(_scaled(logits, params), dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy and _truncates(p)]
    if rows:
        idx = torch.tensor(rows, device=probs.device)
        probs = probs.index_copy(0, idx, _truncate(probs.index_select(0, idx), [params[i] for i in rows]))
    return probs


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row: the first id whose running sum of (unnormalized) weights exceeds u * total, the
    draw every sampled row of :func:`sample` makes."""
    return _inverse_cdf(weights, uniforms)


def _sample_torch(logits: torch.Tensor, temps: torch.Tensor, uniforms: torch.Tensor):
    """The kernel's recipe in torch (argmax for greedy rows, inverse CDF for the others)."""
    t = torch.where(temps > 0, temps, torch.ones_like(temps)).to(logits.device).unsqueeze(1)
    logprobs = torch.log_softmax(logits / t, dim=-1)
    token_ids = logits.argmax(dim=-1)
    sampled = (temps > 0).nonzero().flatten().tolist()
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        drawn = _inverse_cdf(logprobs[rows].exp(), uniforms[rows].to(logits.device))
        token_ids = token_ids.index_copy(0, rows, drawn)
    return token_ids, logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row: the first id whose running sum of (unnormalized) weights exceeds u * total."""
    cdf = weights.cumsum(dim=-1)
    ids = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    # Rounding can leave u * total at the very end: fall back to the last id with mass.
    last = weights.shape[1] - 1 - (weights.flip(-1) > 0).int().argmax(dim=-1)
    return torch.minimum(ids, last)


def _truncates(p: SamplingParams) -> bool:
    return p.top_k != -1 or p.top_p < 1.0 or p.min_p > 0.0


def _sample_truncated(
    logits: torch.Tensor, params: list[SamplingParams], rows: list[int], uniforms: torch.Tensor
) -> torch.Tensor:
    """Inverse-CDF draws over the top-k/top-p/min-p truncated distribution of the given rows."""
    idx = torch.tensor(rows, device=logits.device)
    sub = [params[i] for i in rows]
    probs = torch.softmax(_scaled(logits.index_select(0, idx), sub), dim=-1)
    return _inverse_cdf(_truncate(probs, sub), uniforms[rows].to(logits.device))


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
