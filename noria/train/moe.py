"""MoE in the trainer: rollout routing replay (R3), the route metrics, the load-balancing loss.

What this module owns: turning a micro-batch's ``TrainBatch.routed_experts`` (the engine's routes,
aligned to the predicted token) into the model's ``Routing`` input (``packing.replay_rows``: the
route of each forward position), and what the trainer reports about it. The backend
(``noria.train.fsdp``) calls :func:`micro_batch_routing` before each forward and, in
``train_step``, :func:`route_metrics` and :func:`aux_loss_term` after it::

    TrainBatch.routed_experts [n, L, k] --replay_rows--> engine route of each position
      replay_routes: Routing(replay=...)  -> the MoE layers compute with the engine's experts,
                                             gate weights from the trainer's own router (R3)
      else:          Routing()            -> the layers route by themselves
    after the forward: moe/route_mismatch      (experts used vs the engine's)
                       moe/router_disagreement (the trainer router's own top-k vs the engine's)

Which tokens replay: the positions whose logits give a policy token its logprob (the position
before each policy token). Prompt and environment tokens route by themselves: the engine computes
them in prefill (prefix-cache hits not at all), so it has no route of its own for them to give,
and replaying the routes that produced each policy token is what makes its logprob the engine's.
With shared prefixes, a prompt's last position predicts the first token of every sample; it
replays the route recorded with the first sample's token (``packing.replay_rows``).

The load-balancing loss (``train.loss.router_aux_coef`` > 0) is transformers' formula over the
micro-batch's tokens and MoE layers (``noria.models.moe.Routing.aux_loss``, with the experts the
layers used), weighted by the micro-batch's share of the step's tokens, so the step's term is the
token-weighted mean over micro-batches (not the loss of one forward over the whole batch: the
formula is a product of two means). Nothing here blocks beyond the forward itself; the metrics read
a few counts back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from noria.models.moe import Routing, route_mismatch
from noria.train.backend import Metrics, TrainError
from noria.train.packing import replay_rows
from noria.types import TrainBatch


@dataclass
class MicroBatchRouting:
    """The routing input of one micro-batch's forward and the engine routes it is compared with."""

    routing: Routing
    engine: torch.Tensor | None
    """[n, L, k] engine route of each position (-1: none recorded), or None."""


def moe_shape(lm: nn.Module) -> tuple[int, int] | None:
    """(MoE layers, top-k) of a native MoE model; None for any other model."""
    args = getattr(lm, "args", None)
    layers = getattr(args, "moe_layers", ())
    return (len(layers), args.moe.top_k) if layers else None


def micro_batch_routing(
    lm: nn.Module, mb: TrainBatch, device: torch.device, aux: bool, policy: bool = True
) -> MicroBatchRouting | None:
    """The ``Routing`` for ``mb``'s forward (replaying when ``mb.replay_routes``), or None when the
    model is not MoE or there is nothing to replay, measure or balance. ``policy``: the model
    trained, which must replay what the batch asks it to (a frozen dense teacher need not)."""
    shape = moe_shape(lm)
    if shape is None:
        if policy and mb.routed_experts is not None and mb.replay_routes:
            raise TrainError(
                f"the batch carries MoE routes to replay (rollout.routing_replay), but the policy ({type(lm).__name__}) "
                "has no native MoE layer"
            )
        return None
    if mb.routed_experts is None and not aux:
        return None
    engine = None
    if mb.routed_experts is not None:
        rows = replay_rows(mb)
        if rows.reshape(len(rows), -1).shape[1] != shape[0] * shape[1]:
            raise TrainError(
                f"routed_experts has {tuple(rows.shape[1:])} ids per token; this model routes through {shape[0]} MoE "
                f"layers x top-{shape[1]}"
            )
        engine = rows.reshape(len(rows), *shape).to(device)
    replay = engine[None] if engine is not None and mb.replay_routes else None
    return MicroBatchRouting(Routing(replay=replay, aux=aux), engine)


def route_metrics(r: MicroBatchRouting) -> Metrics:
    """``moe/route_mismatch`` and ``moe/router_disagreement`` as (differing, compared) pairs over the
    (position, MoE layer) pairs that have an engine route."""
    if r.engine is None:
        return {}
    given = r.engine[:, 0, 0] >= 0
    used, n = route_mismatch(r.routing.used_routes()[0], r.engine, given)
    own, _ = route_mismatch(r.routing.routes()[0], r.engine, given)
    if n == 0:
        return {}
    return {"moe/route_mismatch": (float(used), float(n)), "moe/router_disagreement": (float(own), float(n))}


def aux_loss_term(r: MicroBatchRouting, coef: float, mb_tokens: int, step_tokens: int) -> tuple[torch.Tensor, Metrics]:
    """``coef`` x the micro-batch's load-balancing loss x its share of the step's tokens, and the
    ``moe/router_aux_loss`` metric (token-weighted)."""
    aux = r.routing.aux_loss()
    share = mb_tokens / max(step_tokens, 1)
    return coef * share * aux, {"moe/router_aux_loss": (float(aux.detach()) * mb_tokens, float(mb_tokens))}
