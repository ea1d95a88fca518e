"""AdamW with its two moments stored in 16 or 8 bits: ``train.optim.state_dtype`` bfloat16 or int8.

fp32 AdamW keeps 8 bytes of state per trained parameter (the first and second moments): 1.08 GB of
SmolLM2-135M's trainer, twice its fp32 weights. Here the moments are stored compactly and widened to
fp32 only for the update, a slice of ``CHUNK`` elements at a time, so the step's working memory is a
few MB whatever the size of the parameter:

- ``bfloat16``: both moments in bf16 (4 bytes per parameter, half of fp32's).
- ``int8``: block-wise 8-bit quantization (Dettmers et al., "8-bit Optimizers via Block-wise
  Quantization", 2022): every block of ``BLOCK`` (256) consecutive values keeps its absolute
  maximum as an fp32 scale and each value as one byte, the index of the nearest entry of the
  dynamic (exponent + fraction) quantization map scaled to the block. 2 bytes + 2 scales per block
  per parameter: 2.03 bytes per parameter, a quarter of fp32's. The second moment is stored as its
  square root, which has the first moment's dynamic range and is the update's denominator itself,
  so the map's relative precision is the update's relative precision (storing ``v`` itself, the
  map's range of 1e-7 would end at gradients 3e-4 below the block's largest).

Tensors of fewer than ``MIN_QUANTIZED`` values (norms, biases) keep fp32 moments, as
bitsandbytes does. The update is AdamW's (decoupled weight decay, bias correction), computed in fp32
on the fp32 master weights; only the moments are rounded when stored.

Why not a library: bitsandbytes' 8-bit optimizers need its native library (CUDA, or a CPU build
that is not on every machine Noria runs on), and torchao's ``AdamW8bit`` (tried on this repository's
torch 2.13 on a 2-core AMD EPYC Zen 4) compiles its step with ``torch.compile`` per parameter shape:
34 s at the first step for six of SmolLM2's shapes, with inductor's compile workers beside the
trainer, and in eager mode its quantization makes int64 temporaries of every parameter's size
(226 MB for the embedding). This module is eager, chunked and a page long.

Not supported: sharded parameters (FSDP2 DTensors; ``train.backend: single`` only, checked by the
config), sparse gradients, AMSGrad.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

BLOCK = 256
"""Values per quantization block (one fp32 scale each)."""
CHUNK = 1 << 20
"""Values widened to fp32 at once during a step (a multiple of BLOCK)."""
MIN_QUANTIZED = 4096
"""Tensors smaller than this keep fp32 moments."""


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 values of the 8-bit dynamic quantization map in [-1, 1] (signed) or [0, 1], sorted.

    Dettmers (2015, "8-Bit Approximations for Parallelism in Deep Learning"): a decimal exponent
    from 1e-6 to 1 and a linear fraction in [0.1, 1] whose number of steps doubles with each larger
    exponent, plus 0 and 1; the values are the midpoints of the fraction's steps."""
    exponent_bits, fraction_bits = 7, 7  # 8 bits less the sign (signed) or the indicator (unsigned)
    values: list[float] = []
    for i in range(exponent_bits):
        steps = 2 ** (i + fraction_bits - exponent_bits + (0 if signed else 1)) + 1
        bounds = torch.linspace(0.1, 1, steps)
        means = ((bounds[:-1] + bounds[1:]) / 2 * 10 ** (i - exponent_bits + 1)).tolist()
        values += means + ([-m for m in means] if signed else [])
    values += [0.0, 1.0]
    if len(values) != 256:  # pragma: no cover - a property of the arithmetic above
        raise AssertionError(f"dynamic map has {len(values)} values")
    return torch.tensor(sorted(values), dtype=torch.float32)


def code_table(qmap: torch.Tensor) -> torch.Tensor:
    """The code of every bfloat16 bit pattern (65536 uint8): the index of ``qmap``'s entry nearest to it.

    Quantizing looks the code up by the bf16 rounding of the value (``quantize_into``) instead of
    a binary search over the map (``torch.bucketize``: 19 ms per million values here, 5 s a step
    for SmolLM2's two moments; the lookup: a few ms). bf16's relative step (2^-8) is finer than the
    map's (1.4% at its top), so a value's code differs from the exact nearest only within 0.4% of a
    midpoint between two entries."""
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    codes = torch.bucketize(patterns.nan_to_num(0.0).clamp(-1.0, 1.0), (qmap[1:] + qmap[:-1]) / 2)
    return codes.to(torch.uint8)


def quantize_into(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, table: torch.Tensor) -> None:
    """Write fp32 ``x`` (a whole number of blocks, or the tensor's padded tail) as codes (through
    ``code_table``'s ``table``) and block scales."""
    n = codes.numel()
    pad = (-x.numel()) % BLOCK
    xb = (torch.nn.functional.pad(x, (0, pad)) if pad else x).view(-1, BLOCK)
    torch.amax(xb.abs(), dim=1, out=scales).clamp_min_(1e-30)  # the largest |value| of each block
    bits = (xb / scales[:, None]).to(torch.bfloat16).view(torch.int16).view(-1)[:n].int().bitwise_and_(0xFFFF)
    torch.index_select(table, 0, bits, out=codes)  # index_select: 3x faster than table[bits] here


def dequantize(codes: torch.Tensor, scales: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """fp32 values of ``codes`` (a whole number of blocks, or the tensor's tail) under block ``scales``."""
    n = codes.numel()
    values = qmap.index_select(0, codes.int())
    pad = (-n) % BLOCK
    if pad:
        values = torch.nn.functional.pad(values, (0, pad))
    return values.view(-1, BLOCK).mul_(scales[:, None]).view(-1)[:n]


class CompactAdamW(torch.optim.Optimizer):
    """AdamW whose moments are stored in ``state_dtype`` (``torch.bfloat16`` or ``torch.int8``); see the module docstring.

    State per parameter (plain tensors, so checkpoints save it as they save AdamW's): ``step``;
    bf16: ``exp_avg`` and ``exp_avg_sq``; int8: ``exp_avg`` / ``exp_avg_scale`` (codes and block
    scales of the first moment) and ``exp_avg_sqrt`` / ``exp_avg_sqrt_scale`` (of the square root
    of the second); tensors below ``MIN_QUANTIZED`` values: fp32 ``exp_avg`` and ``exp_avg_sq``.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        state_dtype: torch.dtype = torch.int8,
    ) -> None:
        if state_dtype not in (torch.bfloat16, torch.int8):
            raise ValueError(f"state_dtype must be torch.bfloat16 or torch.int8, got {state_dtype}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.state_dtype = state_dtype
        self._tables: dict[tuple[bool, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        # The state is made now, not at the first step: allocated beside the activations and
        # gradients of that step, it left the C heap 0.28 GB larger than it (SmolLM2-135M's first
        # step peaked at 3.25 GB, the next ones at 2.8).
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].update(self._init_state(p))

    def _table(self, signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the map, its ``code_table``) on ``device``."""
        key = (signed, device)
        if key not in self._tables:
            qmap = dynamic_map(signed)
            self._tables[key] = qmap.to(device), code_table(qmap).to(device)
        return self._tables[key]

    def _init_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        n = p.numel()
        state: dict[str, torch.Tensor] = {"step": torch.zeros((), dtype=torch.float32)}
        if n < MIN_QUANTIZED:
            state["exp_avg"] = torch.zeros(n, dtype=torch.float32, device=p.device)
            state["exp_avg_sq"] = torch.zeros(n, dtype=torch.float32, device=p.device)
        elif self.state_dtype == torch.bfloat16:
            state["exp_avg"] = torch.zeros(n, dtype=torch.bfloat16, device=p.device)
            state["exp_avg_sq"] = torch.zeros(n, dtype=torch.bfloat16, device=p.device)
        else:
            blocks = math.ceil(n / BLOCK)
            # Scales of 0: every value is 0 whatever its code.
            state["exp_avg"] = torch.zeros(n, dtype=torch.uint8, device=p.device)
            state["exp_avg_scale"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
            state["exp_avg_sqrt"] = torch.zeros(n, dtype=torch.uint8, device=p.device)
            state["exp_avg_sqrt_scale"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch.optim's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("CompactAdamW does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state.update(self._init_state(p))
                state["step"] += 1
                t = float(state["step"])
                self._update(p, p.grad, state, group["lr"], beta1, beta2, group["eps"], group["weight_decay"], t)
        return loss

    def _update(self, p, grad, state, lr, beta1, beta2, eps, weight_decay, t) -> None:  # noqa: ANN001
        flat_p = p.view(-1) if p.is_contiguous() else p.detach().reshape(-1).clone()
        flat_g = grad.reshape(-1)
        step_size = lr / (1 - beta1**t)
        root_bc2 = math.sqrt(1 - beta2**t)
        quantized = "exp_avg_scale" in state
        if quantized:
            qmap_m, codes_m = self._table(True, p.device)
            qmap_r, codes_r = self._table(False, p.device)
        for a in range(0, flat_p.numel(), CHUNK):
            b = min(a + CHUNK, flat_p.numel())
            g = flat_g[a:b].float()
            if quantized:
                sa, sb = a // BLOCK, math.ceil(b / BLOCK)
                m = dequantize(state["exp_avg"][a:b], state["exp_avg_scale"][sa:sb], qmap_m)
                v = dequantize(state["exp_avg_sqrt"][a:b], state["exp_avg_sqrt_scale"][sa:sb], qmap_r).square_()
            else:
                m, v = state["exp_avg"][a:b].float(), state["exp_avg_sq"][a:b].float()
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            chunk = flat_p[a:b]
            if weight_decay:
                chunk.mul_(1 - lr * weight_decay)
            root = v.sqrt()  # the update's denominator, and what the int8 state stores
            chunk.addcdiv_(m, root.div(root_bc2).add_(eps), value=-step_size)
            if quantized:
                quantize_into(m, state["exp_avg"][a:b], state["exp_avg_scale"][sa:sb], codes_m)
                quantize_into(root, state["exp_avg_sqrt"][a:b], state["exp_avg_sqrt_scale"][sa:sb], codes_r)
            else:
                state["exp_avg"][a:b].copy_(m)
                state["exp_avg_sq"][a:b].copy_(v)
        if flat_p.data_ptr() != p.data_ptr():
            p.copy_(flat_p.view_as(p))


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by ``optimizer``'s state tensors (moments, scales, step counts)."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
