"""The training primitives on one adapter: forward, forward_backward, optim_step.

``forward_backward`` runs one padded forward of the adapter's datums (right padding, so each
datum's logprobs are those of a forward of that datum alone), takes the named loss, and computes
the gradient of the adapter's parameters with ``torch.autograd.grad``. Only a FINITE loss with
FINITE gradients is added to the adapter's ``.grad``; otherwise the call fails with
``NonFiniteStep`` and nothing of any adapter changed (no gradient kept, no weight, no optimizer
state): one tenant's NaN never reaches another's adapter, nor its own. Gradients of several calls
add up until ``optim_step`` applies them with the given Adam parameters and drops them.

Per-token logprobs are returned for every input position (the logprob of ``target_tokens[i]`` after
the tokens up to ``i``), in fp32, as Tinker's ``loss_fn_outputs[i]["logprobs"]``.
"""

from __future__ import annotations

import math

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
    logits = lora.model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    keep = mask.bool()
    seq_index = torch.arange(len(data), device=device).unsqueeze(1).expand_as(ids)[keep]
    return lp[keep], seq_index, lengths


def _outputs(lp: torch.Tensor, lengths: list[int]) -> list[dict]:
    return [{"logprobs": tensor_data(part)} for part in torch.split(lp.detach(), lengths)]


def forward(lora: MultiLora, adapter: Adapter | None, data: list[Datum], loss_name: str, config: dict) -> dict:
    """Logprobs and the loss of ``data`` under the adapter (the base model if None), no gradient."""
    loss_fn, _ = get_loss(loss_name)
    lora.use(adapter.name if adapter else None)
    with torch.no_grad():
        lp, seq_index, lengths = target_logprobs(lora, data)
        _, metrics = loss_fn(lp, _inputs(data, lp.device), seq_index, config)
    return {"loss_fn_output_type": loss_name, "loss_fn_outputs": _outputs(lp, lengths), "metrics": metrics}


def _inputs(data: list[Datum], device: torch.device) -> dict[str, torch.Tensor]:
    keys = set(data[0].inputs)
    if any(set(d.inputs) != keys for d in data):
        raise BadRequest("data: every datum must carry the same loss_fn_inputs")
    return {k: torch.cat([d.inputs[k] for d in data]).to(device) for k in keys}


def forward_backward(lora: MultiLora, adapter: Adapter, data: list[Datum], loss_name: str, config: dict) -> dict:
    """Logprobs, loss and metrics of ``data``; the gradient is added to the adapter's only if finite."""
    loss_fn, _ = get_loss(loss_name)
    lora.use(adapter.name)
    lp, seq_index, lengths = target_logprobs(lora, data)
    loss, metrics = loss_fn(lp, _inputs(data, lp.device), seq_index, config)
    if not math.isfinite(float(loss.detach())):
        raise NonFiniteStep(f"forward_backward ({loss_name}): the loss is {float(loss.detach())}; nothing was applied to adapter {adapter.name}")
    params = list(adapter.params.values())
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
    if not math.isfinite(norm):
        raise NonFiniteStep(f"forward_backward ({loss_name}): the gradient norm is {norm}; nothing was applied to adapter {adapter.name}")
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.grad = g.clone() if p.grad is None else p.grad + g
    adapter.grad_calls += 1
    metrics["grad_norm:mean"] = norm
    return {"loss_fn_output_type": loss_name, "loss_fn_outputs": _outputs(lp, lengths), "metrics": metrics}


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
    return {"metrics": {"grad_norm:mean": float(norm), "step:max": float(adapter.steps)}}
