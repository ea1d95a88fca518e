"""The mixture-of-experts block of Qwen3-MoE, with route capture and route replay.

This module owns what a sparse layer of :class:`~noria.models.decoder.DecoderLM` does instead of
the dense SwiGLU MLP (``DecoderLayer`` builds a :class:`SparseMoeBlock` for the layers
``MoeArgs.is_sparse`` names), the per-call routing record (:class:`Routing`) through which callers
capture and replay routes, the load-balancing loss, and the translation between the stacked
in-memory expert layout and the per-expert layout of HF checkpoint files. Per token::

    x [H] -> router: logits = x @ gate.weight^T in fp32 -> softmax -> top-k experts (own route)
          -> route used: the own route, or the replayed one (given ids; weights recomputed from
             this router's probabilities over those ids, as R3 does)
          -> weights (renormalised to sum 1 when norm_topk_prob) -> sum over the k experts in
             expert-id order of weight_e * down_e(silu(gate_e(x)) * up_e(x))

Layout: parameter names and shapes are transformers 5's in-memory ones
(``mlp.gate.weight`` [E, H], ``mlp.experts.gate_up_proj`` [E, 2I, H] with the gate rows first,
``mlp.experts.down_proj`` [E, H, I]), so ``state_dict()`` names equal transformers' names as for
the dense families, and FSDP2 shards the stacked experts on dim 0. HF checkpoint files hold one
tensor per expert (``mlp.experts.{e}.gate_proj.weight`` ...); :func:`disk_layout` maps between the
two and ``noria.models.checkpoint`` uses it to load and save.

Numerics: the router's logits and softmax are fp32 whatever the model dtype and under autocast
(as Megatron's ``moe_router_dtype=fp32``; transformers computes bf16 logits, so a bf16 model's
routes may differ from transformers' on near ties — fp32 models match it). A route's ids are
sorted before its weights are gathered and summed, so a replayed route equal to the own one (in
any order) gives the same bits. The expert outputs are computed in the model dtype, scaled by the
weights cast to it, and added in expert-id order into zeros in the residual stream's dtype, as
transformers does.

Expert computation, three paths (one result contract):

- exact mode (``exact_dtype`` set by ``DecoderLM.set_exact_numerics``): a loop over experts whose
  matmuls go through ``decoder.row_chunked_linear`` (every matmul exactly ``DETERMINISTIC_ROWS``
  rows, zero-padded; on CUDA the fixed-tile Triton kernel), tokens gathered with ``index_select``
  and added back with ``index_add_`` one expert at a time, so a token's bits never depend on which
  other tokens share the call or the expert (each call adds at most one row per token: no order
  question). The router's logits go through the same fixed-shape matmul.
- CUDA, bf16 (weights in bf16, or fp32 under bf16 autocast: cast first, as autocast casts a
  linear's operands), aligned shapes: ``torch._grouped_mm`` over tokens sorted by expert (CUTLASS on
  sm90; no host synchronisation, so a CUDA graph can hold it); the k expert outputs of a token are
  combined by one ``index_add_``, whose atomics add in no fixed order (not batch-invariant, as
  cuBLAS is not).
- otherwise (CPU, fp32 on CUDA): the same loop as exact mode with plain ``F.linear``, transformers'
  own algorithm. torch's CPU ``_grouped_mm`` is a loop of matmuls too and its backward refuses
  some strides, so it brings nothing here.

Written by hand because transformers' ``Qwen3MoeSparseMoeBlock`` has no route input or output, no
fp32 router and no fixed-shape path, and megatron-core's MoE layer needs its parallel state and
Transformer Engine.

Blocking: the CPU and exact paths read the per-expert token counts on the host (one
synchronisation per layer on CUDA, so a CUDA graph holds only the grouped path:
:func:`graph_capturable`); the grouped path does not. Not guaranteed: exact mode's equality of
bits on CUDA rests on the Triton linear and torch's per-row softmax (checked on a GPU by
``tests/models/test_models_moe_gpu.py``), and nothing makes the grouped path equal to the loop's bits.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from noria.models.config import ModelArgs
from noria.models.decoder import row_chunked_linear

NO_ROUTE = -1
"""A replayed route whose first id is this (the whole row should be) means: route normally."""


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest signed integer dtype that holds expert ids 0..num_experts-1 and :data:`NO_ROUTE`:
    int8 up to 128 experts (Qwen3-30B-A3B), int16 up to 32768."""
    if num_experts <= 128:
        return torch.int8
    if num_experts <= 32768:
        return torch.int16
    return torch.int32


class Routing:
    """Routing of one forward call of a MoE :class:`~noria.models.decoder.DecoderLM`: what to
    replay (input) and what the routers chose (output). Pass it as ``routing=``; MoE layers fill
    it in order. L below is the number of MoE layers, k the experts per token, N = B * T.

    A plain class, not a dataclass: FSDP2 rebuilds dataclass arguments of a forward (casting their
    tensors), which would leave the caller's record empty.
    """

    def __init__(self, replay: torch.Tensor | None = None, aux: bool = False) -> None:
        self.replay = replay
        """Integer [B, T, L, k] expert ids each token must use per MoE layer (any integer dtype); a
        token whose row holds :data:`NO_ROUTE` routes by its own router there. None: no replay."""
        self.aux = aux
        """Accumulate the load-balancing statistics for :meth:`aux_loss` (costs [k, E] per layer)."""
        self.chosen: list[torch.Tensor] = []
        """Output: per MoE layer, the router's own top-k [N, k] in :func:`route_dtype` (under replay
        too: what it would have chosen), in descending probability."""
        self.used: list[torch.Tensor] = []
        """Output: per MoE layer, the experts the layer computed with [N, k] (the replayed ones where
        given, else the own ones), ascending."""
        self.shape: tuple[int, int] | None = None
        """Output: (B, T) of the call."""
        self._counts: torch.Tensor | None = None  # [k, E] routes used, summed over layers
        self._probs: torch.Tensor | None = None  # [E] router probabilities, summed over layers (with grad)
        self._rows = 0  # tokens x layers accumulated

    def routes(self) -> torch.Tensor:
        """The captured own routes, [B, T, L, k] in :func:`route_dtype`."""
        return self._stacked(self.chosen)

    def used_routes(self) -> torch.Tensor:
        """The routes the layers computed with, [B, T, L, k] in :func:`route_dtype`."""
        return self._stacked(self.used)

    def _stacked(self, per_layer: list[torch.Tensor]) -> torch.Tensor:
        if not per_layer or self.shape is None:
            raise ValueError("no routes captured: the forward ran no MoE layer with this Routing")
        return torch.stack(per_layer, dim=1).view(*self.shape, len(per_layer), -1)

    def replay_rows(self, layer: int, n_tokens: int) -> torch.Tensor | None:
        """Replayed ids of MoE layer ``layer`` as [N, k], or None without replay."""
        if self.replay is None:
            return None
        return self.replay.reshape(n_tokens, self.replay.shape[-2], -1)[:, layer]

    def add_aux(self, used: torch.Tensor, probs: torch.Tensor) -> None:
        """Accumulate one layer's used routes [N, k] and probabilities [N, E] (fp32)."""
        counts = torch.zeros(used.shape[1], probs.shape[1], device=probs.device)
        counts.scatter_add_(1, used.t().long(), torch.ones(used.t().shape, device=probs.device))
        total = probs.sum(0)
        self._counts = counts if self._counts is None else self._counts + counts
        self._probs = total if self._probs is None else self._probs + total
        self._rows += used.shape[0]

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of this call, transformers' ``load_balancing_loss_func`` over
        every MoE layer's tokens: ``E * sum_{slot, e} f[slot, e] * P[e]`` with f the fraction of
        token-layer rows sending their slot to e (the routes used: replayed ones under replay)
        and P the mean router probability. k at perfect balance; differentiable through P."""
        if self._probs is None:
            raise ValueError("no load-balancing statistics: build the Routing with aux=True")
        n_experts = self._probs.shape[0]
        return n_experts * (self._counts / self._rows * (self._probs / self._rows)[None]).sum()

    def check_replay(self, batch: int, seq_len: int, moe_layers: int, top_k: int, num_experts: int) -> None:
        """Raise ValueError unless ``replay`` fits the call and holds valid ids (reads it on the host)."""
        if self.replay is None:
            return
        want = (batch, seq_len, moe_layers, top_k)
        if tuple(self.replay.shape) != want:
            raise ValueError(f"routing.replay has shape {tuple(self.replay.shape)}, the call needs {want} (B, T, MoE layers, top-k)")
        if self.replay.dtype.is_floating_point or self.replay.dtype == torch.bool:
            raise ValueError(f"routing.replay must hold integer expert ids, got {self.replay.dtype}")
        r = self.replay.long()
        off = r[..., 0] == NO_ROUTE
        if bool(((r == NO_ROUTE) != off[..., None]).any()):
            raise ValueError(f"routing.replay: a token's row must be all {NO_ROUTE} (route normally) or all expert ids")
        ids = r[~off]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
            raise ValueError(f"routing.replay holds expert ids outside 0..{num_experts - 1}")
        if ids.numel() and bool((ids.sort(-1).values.diff(dim=-1) == 0).any()):
            raise ValueError("routing.replay sends a token to the same expert twice in one layer")


def route_mismatch(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[int, int]:
    """(differing, compared): how many (token, MoE layer) pairs of routes a and b ([..., L, k])
    choose different expert sets (the order within k does not count), over the tokens where
    ``mask`` ([...] bool) is true, and how many pairs were compared."""
    if a.shape != b.shape:
        raise ValueError(f"routes of shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be compared")
    differ = (a.long().sort(-1).values != b.long().sort(-1).values).any(-1)  # [..., L]
    if mask is not None:
        differ = differ[mask.bool()]
    return int(differ.sum()), int(differ.numel())


class Router(nn.Module):
    """The top-k softmax router (HF ``mlp.gate``): ``weight`` [E, H], logits in fp32."""

    exact_dtype: torch.dtype | None = None

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        _uniform_init(self.weight, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, E] for x [N, H] (autocast would make them bf16: it is off here)."""
        if self.exact_dtype is not None:  # the weight as the engine holds it (the trainer's are fp32 masters)
            return row_chunked_linear(x.float(), self.weight.to(self.exact_dtype).float())
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float())


class Experts(nn.Module):
    """The stacked expert weights (HF ``mlp.experts``): ``gate_up_proj`` [E, 2I, H] (gate rows
    first), ``down_proj`` [E, H, I]."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        _uniform_init(self.gate_up_proj, hidden)
        _uniform_init(self.down_proj, intermediate)


@torch.no_grad()
def _uniform_init(p: torch.Tensor, fan_in: int) -> None:
    # nn.Linear's default range, so a model built from arguments is usable as drawn (loading
    # overwrites it; on the meta device it costs nothing).
    if p.device.type != "meta":
        bound = fan_in**-0.5
        p.uniform_(-bound, bound)


class SparseMoeBlock(nn.Module):
    """Router plus experts of one MoE layer; ``moe_index`` is its place among the MoE layers."""

    exact_dtype: torch.dtype | None = None

    def __init__(self, args: ModelArgs, moe_index: int) -> None:
        super().__init__()
        moe = args.moe
        self.moe_index = moe_index
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.route_dtype = route_dtype(moe.num_experts)
        self.gate = Router(args.hidden_size, moe.num_experts)
        self.experts = Experts(args.hidden_size, moe.intermediate_size, moe.num_experts)

    def forward(self, x: torch.Tensor, routing: Routing | None = None) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]; records its routes in ``routing`` when one is given."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.gate(flat)
        probs = torch.softmax(logits, dim=-1)
        own = torch.topk(probs, self.top_k, dim=-1).indices
        replay = routing.replay_rows(self.moe_index, len(flat)) if routing is not None else None
        used = own if replay is None else torch.where(replay[:, :1] == NO_ROUTE, own, replay.long())
        # Ascending ids: the weights' sum below then has one order whatever order a route came in
        # (a replayed route equal to the own one gives the same bits).
        used = used.sort(dim=-1).values
        weights = probs.gather(-1, used)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if routing is not None:
            routing.shape = (shape[0], shape[1])
            routing.chosen.append(own.to(self.route_dtype))
            routing.used.append(used.to(self.route_dtype))
            if routing.aux:
                routing.add_aux(used, probs)
        out = self._experts(flat, used, weights)
        return out.view(shape)

    def _experts(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        if self.exact_dtype is not None:
            return loop_experts(x.to(self.exact_dtype), idx, weights, gate_up, down, _exact_linear(self.exact_dtype))
        if grouped_ok(x, gate_up, down):
            return grouped_experts(x, idx, weights, gate_up, down)
        if _autocast_bf16(x):
            # Training under bf16 autocast keeps fp32 master weights and an fp32 residual stream:
            # cast as autocast casts F.linear's operands, so the grouped GEMM runs, not the loop.
            bf = torch.bfloat16
            half = (x.to(bf), gate_up.to(bf), down.to(bf))
            if grouped_ok(*half):
                return grouped_experts(half[0], idx, weights, half[1], half[2]).to(x.dtype)
        return loop_experts(x, idx, weights, gate_up, down, F.linear)


def _autocast_bf16(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16


def _exact_linear(dtype: torch.dtype):
    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return row_chunked_linear(x, weight.to(dtype))

    return linear


def _sorted_by_expert(idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, token, counts): the (token, slot) pairs sorted by expert, stably (so each expert's
    tokens ascend), the token of each, and the number of pairs per expert (on idx's device)."""
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=idx.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order, order // idx.shape[1], counts


def loop_experts(x, idx, weights, gate_up, down, linear) -> torch.Tensor:
    """Experts one at a time (transformers' algorithm): x [N, H], idx/weights [N, k] -> [N, H].
    ``linear(x, w)`` computes ``x @ w^T`` (``F.linear`` or a fixed-shape one)."""
    order, token, counts = _sorted_by_expert(idx, gate_up.shape[0])
    slot_weights = weights.reshape(-1)[order]
    # unbind, not gate_up[e]: its backward stacks the experts' gradients once, where E selects
    # would each add a zero-filled gradient of the whole tensor.
    gate_ups, downs = gate_up.unbind(0), down.unbind(0)
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        rows = token[start : start + n]
        g, u = linear(x.index_select(0, rows), gate_ups[e]).chunk(2, dim=-1)
        y = linear(F.silu(g) * u, downs[e])
        # Under autocast y is bf16 while x (the residual stream) is fp32: added in x's dtype, as HF.
        out.index_add_(0, rows, (y * slot_weights[start : start + n, None].to(y.dtype)).to(out.dtype))
        start += n
    return out


def grouped_ok(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether :func:`grouped_experts` runs here: CUDA, bf16, torch has ``_grouped_mm``, and every
    row stride is a multiple of 16 bytes (its kernels' requirement)."""
    return (
        x.is_cuda
        and x.dtype == gate_up.dtype == down.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and gate_up.shape[-1] % 8 == 0
        and down.shape[-1] % 8 == 0
    )


def graph_capturable(model: nn.Module) -> bool:
    """Whether a CUDA graph can hold ``model``'s MoE layers: each runs the grouped path (the loop
    reads per-expert counts on the host, which a capture forbids). True for a dense model."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    return all(
        hasattr(torch, "_grouped_mm")
        and b.experts.gate_up_proj.dtype == b.experts.down_proj.dtype == torch.bfloat16
        and b.experts.gate_up_proj.shape[-1] % 8 == 0
        and b.experts.down_proj.shape[-1] % 8 == 0
        for b in blocks
    )


def grouped_experts(x, idx, weights, gate_up, down) -> torch.Tensor:
    """All experts in two ``torch._grouped_mm`` calls over the (token, slot) pairs sorted by
    expert; no host synchronisation. x [N, H], idx/weights [N, k] -> [N, H]."""
    order, token, counts = _sorted_by_expert(idx, gate_up.shape[0])
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = torch._grouped_mm(x.index_select(0, token), gate_up.transpose(1, 2), offs=offs)
    g, u = h.chunk(2, dim=-1)
    y = torch._grouped_mm((F.silu(g) * u).contiguous(), down.transpose(1, 2), offs=offs)
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))


_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<leaf>gate_up_proj|down_proj)$")
_PIECE = re.compile(r"^(?P<prefix>.*\.experts)\.\d+\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def stacked_name(disk_name: str) -> str | None:
    """The stacked state-dict name a per-expert checkpoint tensor belongs to
    (``...experts.3.up_proj.weight`` -> ``...experts.gate_up_proj``), or None for another name."""
    m = _PIECE.match(disk_name)
    if m is None:
        return None
    return f"{m['prefix']}.{'down_proj' if m['proj'] == 'down_proj' else 'gate_up_proj'}"


def disk_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (state-dict names) as HF checkpoint files name it: each stacked expert tensor
    becomes one tensor per expert (``experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``),
    as **views** of it (copying into them fills the stacked tensor); other tensors pass through."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _STACKED.match(name)
        if m is None:
            out[name] = t
            continue
        prefix = m["prefix"]
        for e in range(t.shape[0]):
            if m["leaf"] == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
            else:
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
    return out
