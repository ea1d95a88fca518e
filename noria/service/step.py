"""The training primitives on one adapter: forward, forward_backward, optim_step.

``run_calls`` runs forward and forward_backward calls of several adapters (one call per adapter)
as ONE padded forward in which each row has its own adapter (``MultiLora.per_row``; right padding,
so each datum's logprobs are those of a forward of that datum alone, up to float rounding), takes
each call's named loss on its own rows, and computes the gradients of the adapters' parameters
with one ``torch.autograd.grad`` over the sum of the finite losses (rows never mix in a causal LM,
so each adapter's gradient is that of its own loss). Only a FINITE loss with
FINITE gradients is added to the adapter's ``.grad``; otherwise the call fails with
``NonFiniteStep`` and nothing of any adapter changed (no gradient kept, no weight, no optimizer
state): one tenant's NaN never reaches another's adapter, nor its own. Gradients of several calls
add up until ``optim_step`` applies them with the given Adam parameters and drops them.

Per-token logprobs are returned for every input position (the logprob of ``target_tokens[i]`` after
the tokens up to ``i``), in fp32, as Tinker's ``loss_fn_outputs[i]["logprobs"]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from noria.errors import NoriaError
from noria.service.adapters import Adapter, MultiLora
from noria.service.losses import get_loss
from noria.service.wire import BadRequest, Datum, tensor_data


class NonFiniteStep(NoriaError):
    """A call whose loss or gradient is not finite: refused, every adapter left as it was."""


def target_logprobs(lora: MultiLora, data: list[Datum]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Logprobs of the targets [N] (datums concatenated, with the graph), seq_index [N], lengths."""
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
    logits = lora.model(input_ids=ids, attention_mask=mask if padded else None, use_cache=False).logits.float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    keep = mask.bool()
    seq_index = torch.arange(len(data), device=device).unsqueeze(1).expand_as(ids)[keep]
    return lp[keep], seq_index, lengths


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


def run_calls(lora: MultiLora, calls: list[Call]) -> list[Outcome]:
    """Several calls (at most one per adapter) in ONE forward, each row with its own adapter; then
    one backward of the sum of the finite losses. Each call gets its result or its own error."""
    names = [c.adapter.name if c.adapter else None for c in calls for _ in c.data]
    with lora.per_row(names), torch.set_grad_enabled(any(c.backward for c in calls)):
        lp, seq_index, lengths = target_logprobs(lora, [d for c in calls for d in c.data])
    outcomes: list[Outcome] = []
    losses: dict[int, torch.Tensor] = {}
    tok0 = row0 = 0
    for i, c in enumerate(calls):
        rows = len(c.data)
        n = sum(lengths[row0 : row0 + rows])
        part, seqs = lp[tok0 : tok0 + n], seq_index[tok0 : tok0 + n] - row0
        try:
            loss, metrics = get_loss(c.loss_name)[0](part, _inputs(c.data, lp.device), seqs, c.config)
            if c.backward and not math.isfinite(float(loss.detach())):
                raise NonFiniteStep(f"forward_backward ({c.loss_name}): the loss is {float(loss.detach())}; nothing was applied to adapter {c.adapter.name}")
            if c.backward:
                losses[i] = loss
            out = {"loss_fn_output_type": c.loss_name, "loss_fn_outputs": _outputs(part, lengths[row0 : row0 + rows]), "metrics": metrics}
            outcomes.append((out, None))
        except Exception as e:  # noqa: BLE001 -- this call's failure is its own answer, not the batch's
            outcomes.append((None, e))
        tok0, row0 = tok0 + n, row0 + rows
    if losses:
        _backward(calls, losses, outcomes)
    return outcomes


def _backward(calls: list[Call], losses: dict[int, torch.Tensor], outcomes: list[Outcome]) -> None:
    """Gradients of the finite losses; each adapter's is added to its ``.grad`` only if finite."""
    params = {i: list(calls[i].adapter.params.values()) for i in losses}
    flat = [p for i in losses for p in params[i]]
    grads = iter(torch.autograd.grad(sum(losses.values()), flat, allow_unused=True))
    for i in losses:
        adapter, mine = calls[i].adapter, [next(grads) for _ in params[i]]
        mine = [torch.zeros_like(p) if g is None else g for p, g in zip(params[i], mine)]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in mine])))
        if not math.isfinite(norm):
            message = f"forward_backward ({calls[i].loss_name}): the gradient norm is {norm}; nothing was applied to adapter {adapter.name}"
            outcomes[i] = (None, NonFiniteStep(message))
            continue
        with torch.no_grad():
            for p, g in zip(params[i], mine):
                p.grad = g.clone() if p.grad is None else p.grad + g
        adapter.grad_calls += 1
        outcomes[i][0]["metrics"]["grad_norm:mean"] = norm


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
