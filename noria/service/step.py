"""The training primitives on one adapter: forward, forward_backward, optim_step.

``run_calls`` runs forward and forward_backward calls of several adapters (one call per adapter)
together, in padded micro-batches of at most ``service.micro_batch_tokens`` tokens in which each
row has its own adapter (``MultiLora.per_row``; right padding, so each datum's logprobs are those
of a forward of that datum alone, up to float rounding), takes each call's named loss on its own
rows of each micro-batch, and computes the gradients of the adapters' parameters with one
``torch.autograd.grad`` per micro-batch over the sum of its finite losses (rows never mix in a
causal LM, so each adapter's gradient is that of its own loss; losses are sums over tokens, so a
call's loss and gradient are the sums over its micro-batches). Only a FINITE loss with
FINITE gradients is added to the adapter's ``.grad``; otherwise the call fails with
``NonFiniteStep`` and nothing of any adapter changed (no gradient kept, no weight, no optimizer
state): one tenant's NaN never reaches another's adapter, nor its own. Gradients of several calls
add up until ``optim_step`` applies them with the given Adam parameters and drops them.

Per-token logprobs are returned for every input position (the logprob of ``target_tokens[i]`` after
the tokens up to ``i``), in fp32, as Tinker's ``loss_fn_outputs[i]["logprobs"]``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from noria.errors import NoriaError
from noria.service.adapters import Adapter, MultiLora
from noria.service.losses import get_loss
from noria.service.wire import BadRequest, Datum, tensor_data


class NonFiniteStep(NoriaError):
    """A call whose loss or gradient is not finite: refused, every adapter left as it was."""


def target_logprobs(lora: MultiLora, data: list[Datum]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Logprobs of the targets [N] (datums concatenated, with the graph), seq_index [N], lengths.

    With ``lora.chunk_tokens`` the LM head runs on that many tokens at a time, each chunk's logits
    recomputed in backward (``noria.train.logprobs.token_logprobs``, the trainer's): only one chunk
    of [tokens, vocab] logits is alive at once."""
    device = lora.device
    lengths = [len(d.tokens) for d in data]
    width = max(lengths)
    ids = torch.zeros(len(data), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(data), width, dtype=torch.long, device=device)
    targets = torch.zeros(len(data), width, dtype=torch.long, device=device)
    for i, d in enumerate(data):
        ids[i, : lengths[i]] = torch.tensor(d.tokens, device=device)
        mask[i, : lengths[i]] = 1
        targets[i, : lengths[i]] = d.targets.to(device)
    padded = min(lengths) < width  # without padding no mask: attention takes its causal fast path
    keep = mask.bool()
    head = lora.chunked_head()
    if head is None:
        logits = lora.model(input_ids=ids, attention_mask=mask if padded else None, use_cache=False).logits.float()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)[keep]
    else:
        from noria.train.logprobs import token_logprobs

        body, head = head
        hidden = body(input_ids=ids, attention_mask=mask if padded else None, use_cache=False).last_hidden_state
        where = keep.flatten().nonzero().squeeze(-1)  # each kept position scores its own target
        flat = hidden.reshape(-1, hidden.shape[-1])
        lp = token_logprobs(flat, head, targets.flatten(), torch.tensor([0, flat.shape[0]]), lora.chunk_tokens, pairs=(where, where))[0][where]
    seq_index = torch.arange(len(data), device=device).unsqueeze(1).expand_as(ids)[keep]
    return lp, seq_index, lengths


def _outputs(lp: torch.Tensor, lengths: list[int]) -> list[dict]:
    return [{"logprobs": tensor_data(part)} for part in torch.split(lp.detach(), lengths)]


@dataclass
class Call:
    """One forward or forward_backward call of a batch: its adapter (None: the base model) and data."""

    adapter: Adapter | None
    data: list[Datum]
    loss_name: str
    config: dict
    backward: bool


def _inputs(data: list[Datum], device: torch.device) -> dict[str, torch.Tensor]:
    keys = set(data[0].inputs)
    if any(set(d.inputs) != keys for d in data):
        raise BadRequest("data: every datum must carry the same loss_fn_inputs")
    return {k: torch.cat([d.inputs[k] for d in data]).to(device) for k in keys}


Outcome = tuple[dict | None, BaseException | None]


def micro_batches(lengths: list[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive row ranges [lo, hi) whose padded size (rows x the longest row) stays within
    ``budget`` tokens; a row longer than the budget gets a range of its own."""
    out, lo, width = [], 0, 0
    for i, n in enumerate(lengths):
        if i > lo and (i + 1 - lo) * max(width, n) > budget:
            out.append((lo, i))
            lo, width = i, 0
        width = max(width, n)
    return out + ([(lo, len(lengths))] if lengths else [])


@dataclass
class _Tally:
    """One call's results so far, over the micro-batches its rows fall in."""

    parts: list[torch.Tensor] = field(default_factory=list)
    metrics: dict[str, list[float]] = field(default_factory=dict)
    grads: list[torch.Tensor] | None = None
    error: BaseException | None = None

    def add_metrics(self, metrics: dict[str, float], tokens: int) -> None:
        """Tinker's ``name:sum`` metrics add up over the micro-batches; any other is a token-weighted mean."""
        for key, value in metrics.items():
            total, weight = self.metrics.get(key, [0.0, 0.0])
            self.metrics[key] = [total + value, weight] if key.endswith(":sum") else [total + value * tokens, weight + tokens]

    def merged(self) -> dict[str, float]:
        return {k: total if k.endswith(":sum") else total / max(weight, 1.0) for k, (total, weight) in self.metrics.items()}


def run_calls(lora: MultiLora, calls: list[Call], micro_batch_tokens: int = 2048) -> list[Outcome]:
    """Several calls (at most one per adapter) through the model together, each row with its own
    adapter, in micro-batches of at most ``micro_batch_tokens`` padded tokens (a merged batch of a
    few tenants' calls would otherwise hold every layer's activations of all their tokens at once:
    four tenants of the cookbook loop on SmolLM2 took 23 GB). Every loss is a sum over tokens, so
    each call's loss and gradient are the sums of its micro-batches'; its gradient reaches its
    adapter's ``.grad`` only when the whole is finite. Each call gets its result or its own error."""
    rows = [(i, j) for i, c in enumerate(calls) for j in range(len(c.data))]
    names = [c.adapter.name if c.adapter else None for c in calls for _ in c.data]
    tallies = [_Tally() for _ in calls]
    for lo, hi in micro_batches([len(calls[i].data[j].tokens) for i, j in rows], micro_batch_tokens):
        backward = any(calls[i].backward and tallies[i].error is None for i, _ in rows[lo:hi])
        # The backward runs inside per_row too: with lora.checkpointing, it recomputes each layer's forward,
        # which must see the same row adapters.
        with lora.per_row(names[lo:hi]):
            with torch.set_grad_enabled(backward):
                lp, seq_index, lengths = target_logprobs(lora, [calls[i].data[j] for i, j in rows[lo:hi]])
            losses: dict[int, torch.Tensor] = {}
            tok0 = row0 = 0
            for i, group in itertools.groupby(rows[lo:hi], key=lambda row: row[0]):  # rows come call by call
                mine = [calls[i].data[j] for _, j in group]
                n = sum(lengths[row0 : row0 + len(mine)])
                part, seqs = lp[tok0 : tok0 + n], seq_index[tok0 : tok0 + n] - row0
                tok0, row0 = tok0 + n, row0 + len(mine)
                if tallies[i].error is None:
                    _score(calls[i], tallies[i], part, seqs, mine, losses, i)
            if losses:
                _accumulate(calls, tallies, losses)
    return [_outcome(c, t) for c, t in zip(calls, tallies)]


def _score(call: Call, tally: _Tally, part: torch.Tensor, seqs: torch.Tensor, data: list[Datum], losses: dict, i: int) -> None:
    """The call's loss on its rows of one micro-batch: logprobs and metrics kept, the loss queued for backward."""
    try:
        loss, metrics = get_loss(call.loss_name)[0](part, _inputs(data, part.device), seqs, call.config)
        if call.backward and not math.isfinite(float(loss.detach())):
            raise NonFiniteStep(f"forward_backward ({call.loss_name}): the loss is {float(loss.detach())}; nothing was applied to adapter {call.adapter.name}")
        tally.parts.append(part.detach())
        tally.add_metrics(metrics, part.numel())
        if call.backward:
            losses[i] = loss
    except Exception as e:  # noqa: BLE001 -- this call's failure is its own answer, not the batch's
        tally.error = e


def _accumulate(calls: list[Call], tallies: list[_Tally], losses: dict[int, torch.Tensor]) -> None:
    """One backward of a micro-batch's finite losses; each call's gradient added to its own tally."""
    params = {i: list(calls[i].adapter.params.values()) for i in losses}
    grads = iter(torch.autograd.grad(sum(losses.values()), [p for i in losses for p in params[i]], allow_unused=True))
    for i in losses:
        mine = [torch.zeros_like(p) if g is None else g for p, g in zip(params[i], [next(grads) for _ in params[i]])]
        tallies[i].grads = mine if tallies[i].grads is None else [a + b for a, b in zip(tallies[i].grads, mine)]


def _outcome(call: Call, tally: _Tally) -> Outcome:
    """The call's answer; a forward_backward's whole gradient, if finite, added to its adapter's ``.grad``."""
    if tally.error is not None:
        return None, tally.error
    lp = torch.cat(tally.parts) if tally.parts else torch.zeros(0)
    out = {"loss_fn_output_type": call.loss_name, "loss_fn_outputs": _outputs(lp, [len(d.tokens) for d in call.data]),
           "metrics": tally.merged()}  # fmt: skip
    if not call.backward:
        return out, None
    adapter, grads = call.adapter, tally.grads or [torch.zeros_like(p) for p in call.adapter.params.values()]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
    if not math.isfinite(norm):
        return None, NonFiniteStep(f"forward_backward ({call.loss_name}): the gradient norm is {norm}; nothing was applied to adapter {adapter.name}")
    with torch.no_grad():
        for p, g in zip(adapter.params.values(), grads):
            p.grad = g.clone() if p.grad is None else p.grad + g
    adapter.grad_calls += 1
    out["metrics"]["grad_norm:mean"] = norm
    return out, None


ADAM_KEYS = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
"""Tinker's ``AdamParams`` and their defaults."""


def read_adam(params: object) -> dict[str, float]:
    """``adam_params`` of an optim_step request, with Tinker's defaults; a ``BadRequest`` naming a bad field."""
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise BadRequest("adam_params: needs an object")
    unknown = sorted(set(params) - set(ADAM_KEYS))
    if unknown:
        raise BadRequest(f"adam_params: unknown fields {unknown}; known: {sorted(ADAM_KEYS)}")
    out = {k: params.get(k, v) for k, v in ADAM_KEYS.items()}
    for k, v in out.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise BadRequest(f"adam_params.{k}: needs a finite number >= 0, got {v!r}")
    if not (out["beta1"] < 1 and out["beta2"] < 1):
        raise BadRequest("adam_params: beta1 and beta2 must be < 1")
    return {k: float(v) for k, v in out.items()}


def optim_step(adapter: Adapter, adam: dict[str, float]) -> dict:
    """One AdamW step of the adapter's own optimizer on the gradients gathered since the last one."""
    if adapter.grad_calls == 0:
        raise NoriaError(f"optim_step on adapter {adapter.name}: no forward_backward since the last step, nothing to apply")
    params = list(adapter.params.values())
    for group in adapter.optimizer.param_groups:
        group.update(lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]), eps=adam["eps"], weight_decay=adam["weight_decay"])
    norm = torch.nn.utils.clip_grad_norm_(params, adam["grad_clip_norm"] if adam["grad_clip_norm"] > 0 else float("inf"))
    adapter.optimizer.step()
    adapter.optimizer.zero_grad(set_to_none=True)
    adapter.grad_calls = 0
    adapter.steps += 1
    adapter.version += 1
    return {"metrics": {"grad_norm:mean": float(norm), "step:max": float(adapter.steps)}}
