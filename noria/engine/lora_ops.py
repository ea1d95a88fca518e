"""The batched LoRA matmuls: every row of a step gets its own adapter's delta (torch ops only).

A targeted layer's stack (:class:`LoraStack`) holds every slot's A as ``a`` [S, r, K] and B
transposed as ``bt`` [S, r, N] (S = ``engine.lora_max_adapters``, r the largest rank loaded,
lower ranks zero-padded). A forward with adapter rows carries a :class:`LoraBatch`: the slot of
each flattened token (-1: base). Three ways to apply it, all in this module:

- ``stacked`` (the default): one matmul of the rows with the A of every slot up to the highest
  one used, ``h = x @ a[:u].view(u r, K).T`` [T, u r]; ``h`` times a mask that keeps, in each row,
  its own slot's r columns times its scaling (zeros elsewhere); then ``h @ bt[:u].view(u r, N)``.
  Three ops per layer whatever the mix; the zeros make other slots' terms exact zeros, so a row's
  delta is its adapter's alone (non-finite adapter values are refused at load for that reason).
  It computes u r columns for every row, where only r count.
- ``grouped`` (S-LoRA style): per adapter in the step, its rows' matmuls with its A and B and an
  ``index_add_``: four ops per adapter per layer, only the useful multiply-adds.
- ``gathered`` (Punica BGMV style): each adapter row's A and B gathered ([T, r, K], [T, r, N]) and
  two batched matmuls: four ops per layer, but a copy of r (K + N) values per row.

On the CPU's fast decoder (``noria.engine.inference``, packed matmuls) ``stacked`` runs once per
fused matmul rather than per module (:class:`GroupWeights`: q, k and v share one A matmul and one
B matmul, as do gate and up).

Why ``stacked`` is the default (``noria bench engine --lora N``, SmolLM2-135M in bf16, rank 16 on
all seven projections, batch 16, 64 new tokens; AMD EPYC Zen 4 with AVX-512 and AVX512_BF16, 2
cores shared with other work, so figures are noisy and only ratios within one run count): decode
tokens/s with every row on an adapter, against the base model in the same batch:

  =========  =====  =======  =======  ========
  adapters   base   stacked  grouped  gathered
  =========  =====  =======  =======  ========
  1          244.2  193.4    152.6    81.7
  4          228.6  160.4    60.3     82.5
  16         230.2  113.9    49.2     79.3
  =========  =====  =======  =======  ========

At decode sizes a step is bound by the number of small matmuls, not their multiply-adds: the
extra columns of ``stacked`` cost less than ``grouped``'s per-adapter calls and ``gathered``'s
per-row weight copies. No hand kernel was written: these torch ops run on the CPU and CUDA alike;
a fused kernel could cut the per-call cost that dominates here (not measured).

Deterministic mode (``engine.deterministic``): ``stacked`` over all S slots (a fixed shape) with
both matmuls through ``row_chunked_linear``, so a row's delta has the same bits whatever else
shares the step: a mixed batch gives each row the bits of its adapter served alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from noria.models.decoder import row_chunked_linear

STRATEGIES = ("stacked", "grouped", "gathered")
STRATEGY = "stacked"
"""The strategy the engine uses (see the module docstring; ``noria bench engine --lora`` sets the others)."""


@dataclass
class LoraBatch:
    """The row -> adapter mapping of one forward, in the forms the strategies need."""

    strategy: str
    hi: int
    """Slots 0 .. hi - 1 take part (stacked)."""
    mask: torch.Tensor | None = None
    """stacked: [T, hi r], each row's scaling on its slot's r columns, zeros elsewhere."""
    groups: list[tuple[int, torch.Tensor | slice, float]] | None = None
    """grouped: (slot, its rows (a slice when they are one run), scaling)."""
    rows: torch.Tensor | None = None
    """gathered: the rows that have an adapter [R]."""
    row_slots: torch.Tensor | None = None
    """gathered: their slots [R]."""
    row_scale: torch.Tensor | None = None
    """gathered: their scalings [R, 1]."""
    exact: bool = False
    slot_mask: torch.Tensor | None = None
    """stacked: [T, hi], each row's scaling at its slot, zeros elsewhere."""
    _group_masks: dict[int, torch.Tensor] | None = None

    def group_mask(self, width: int) -> torch.Tensor:
        """stacked: [T, hi width], each row's scaling on its slot's ``width`` columns (a group's)."""
        masks = self._group_masks if self._group_masks is not None else {}
        self._group_masks = masks
        if width not in masks:
            t, hi = self.slot_mask.shape
            masks[width] = self.slot_mask[:, :, None].expand(t, hi, width).reshape(t, hi * width).contiguous()
        return masks[width]

    @classmethod
    def build(
        cls, slots: list[int], scaling: list[float], rank: int, capacity: int, dtype: torch.dtype,
        device: torch.device, deterministic: bool = False, strategy: str | None = None,
    ) -> LoraBatch:
        """From one slot per flattened token (-1: base) and each slot's scaling."""
        strategy = "stacked" if deterministic else (strategy or STRATEGY)
        if strategy == "stacked":
            hi = capacity if deterministic else max(slots) + 1
            per_slot = torch.zeros(len(slots), hi)
            for row, slot in enumerate(slots):
                if slot >= 0:
                    per_slot[row, slot] = scaling[slot]
            per_slot = per_slot.to(device=device, dtype=dtype)
            batch = cls(strategy, hi, exact=deterministic, slot_mask=per_slot)
            batch.mask = batch.group_mask(rank)
            return batch
        if strategy == "grouped":
            groups = []
            for slot in sorted(set(s for s in slots if s >= 0)):
                rows = [i for i, s in enumerate(slots) if s == slot]
                where = slice(rows[0], rows[-1] + 1) if rows[-1] - rows[0] + 1 == len(rows) else torch.tensor(rows, device=device)
                groups.append((slot, where, scaling[slot]))
            return cls(strategy, 0, groups=groups)
        if strategy == "gathered":
            rows = [i for i, s in enumerate(slots) if s >= 0]
            row_slots = [slots[i] for i in rows]
            return cls(
                strategy, 0, rows=torch.tensor(rows, device=device), row_slots=torch.tensor(row_slots, device=device),
                row_scale=torch.tensor([[scaling[s]] for s in row_slots], dtype=dtype, device=device),
            )
        raise ValueError(f"unknown LoRA strategy {strategy!r}; known: {STRATEGIES}")


class LoraStack:
    """Every slot's A and B of one targeted layer; see the module docstring."""

    def __init__(self, in_features: int, out_features: int, capacity: int, rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.a = torch.zeros(capacity, rank, in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(capacity, rank, out_features, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.bt.nbytes

    def write(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Slot ``slot`` := A [r, K], B [N, r] (r <= the stack's rank; the rest zeros)."""
        r = a.shape[0]
        self.a[slot].zero_()
        self.bt[slot].zero_()
        self.a[slot, :r].copy_(a)
        self.bt[slot, :r].copy_(b.t())

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.bt[slot].zero_()

    def grow(self, rank: int) -> None:
        """Widen every slot to ``rank`` (zero-padded; the deltas stay the same)."""
        old = self.a.shape[1]
        a = self.a.new_zeros(self.a.shape[0], rank, self.in_features)
        bt = self.bt.new_zeros(self.bt.shape[0], rank, self.out_features)
        a[:, :old].copy_(self.a)
        bt[:, :old].copy_(self.bt)
        self.a, self.bt = a, bt

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        """``y`` (the layer's output for ``x`` [..., K]) plus each row's delta, in place."""
        flat = x.reshape(-1, self.in_features)
        if batch.strategy == "stacked":
            d = self._stacked(flat, batch)
        elif batch.strategy == "grouped":
            d = self._grouped(flat, batch)
        else:
            d = self._gathered(flat, batch)
        return y.add_(d.view(y.shape))

    def _stacked(self, flat: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        hi, r = batch.hi, self.a.shape[1]
        a = self.a[:hi].view(hi * r, self.in_features)
        bt = self.bt[:hi].view(hi * r, self.out_features)
        if batch.exact:
            h = row_chunked_linear(flat, a).mul_(batch.mask)
            return row_chunked_linear(h, bt.t().contiguous())  # exact_cuda's kernels read a contiguous weight
        return torch.mm(torch.mm(flat, a.t()).mul_(batch.mask), bt)

    def _grouped(self, flat: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        out = flat.new_zeros(flat.shape[0], self.out_features)
        for slot, rows, scaling in batch.groups:
            if isinstance(rows, slice):
                out[rows] = torch.mm(torch.mm(flat[rows], self.a[slot].t()).mul_(scaling), self.bt[slot])
            else:
                h = torch.mm(flat.index_select(0, rows), self.a[slot].t()).mul_(scaling)
                out.index_add_(0, rows, torch.mm(h, self.bt[slot]))
        return out

    def _gathered(self, flat: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        out = flat.new_zeros(flat.shape[0], self.out_features)
        a = self.a.index_select(0, batch.row_slots)  # [R, r, K]
        bt = self.bt.index_select(0, batch.row_slots)  # [R, r, N]
        h = torch.bmm(a, flat.index_select(0, batch.rows)[:, :, None]).mul_(batch.row_scale[:, :, None])  # [R, r, 1]
        out.index_copy_(0, batch.rows, torch.bmm(h.transpose(1, 2), bt)[:, 0])
        return out


GROUPS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
          "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}  # fmt: skip
"""The fast decoder's matmuls (``noria.engine.inference``) and the modules each stands for, in output order."""


class GroupWeights:
    """``stacked`` for one fast-decoder matmul standing for M modules (q, k, v: M = 3): one A of
    every (slot, module) pair, [hi M r, K], and one B spreading each pair onto its module's output
    columns, [N_1 + ... + N_M, hi M r] (zeros elsewhere), so the group costs two matmuls, a mask
    product and an add, whatever M. Made from the layer stacks for a given ``hi``; an adapter's
    load or update rewrites its slot in place (:meth:`refresh`: an update copies one slot, where
weights prepacked for oneDNN would be packed again whole). Not prepacked: in ``noria bench engine
--lora 4`` (batch 16) prepacked group weights gave 0.61x of the base model's tokens/s and plain
ones 0.66x, within the noise of the shared machine."""

    def __init__(self, stacks: list[LoraStack | None], sizes: list[int], hi: int, rank: int) -> None:
        first = next(s for s in stacks if s is not None)
        k, m, width = first.in_features, len(stacks), sum(sizes)
        self.stacks, self.sizes, self.hi, self.rank = stacks, sizes, hi, rank
        self.width = m * rank
        """Columns of one slot in the group's h."""
        self.a = first.a.new_zeros(hi * m * rank, k)
        self.b = first.a.new_zeros(width, hi * m * rank)
        for slot in range(hi):
            self.refresh(slot)

    def refresh(self, slot: int) -> None:
        """Copy ``slot``'s A and B from the layer stacks (after a load, update or unload)."""
        if slot >= self.hi:
            return
        m = len(self.stacks)
        a = self.a.view(self.hi, m, self.rank, -1)
        b = self.b.view(-1, self.hi, m, self.rank)
        start = 0
        for i, (stack, n) in enumerate(zip(self.stacks, self.sizes)):
            if stack is not None:
                a[slot, i] = stack.a[slot]
                b[start : start + n, slot, i] = stack.bt[slot].t()
            start += n

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        h = torch.nn.functional.linear(flat, self.a).mul_(batch.group_mask(self.width))
        return y.add_(torch.nn.functional.linear(h, self.b).view(y.shape))


class LoraPackedLayer:
    """A fast-decoder layer (``noria.engine.inference``: fused qkv, o, gate_up, down) whose four
    matmuls also add the current batch's deltas of the modules they stand for: each through its
    :class:`GroupWeights` (``stacked``), or module by module (the other strategies)."""

    def __init__(self, packed, registry, index: int) -> None:
        for kind, modules in GROUPS.items():
            names = [f"model.layers.{index}.{m}" for m in modules]
            layer = getattr(packed, kind)
            weights = registry.group_weights(index, kind, layer.sizes) if registry.batch.strategy == "stacked" else None
            setattr(self, kind, _Group(layer, registry, names, weights))


class _Group:
    """One packed matmul standing for several modules (outputs concatenated in ``sizes`` order)."""

    def __init__(self, packed, registry, modules: list[str], weights: GroupWeights | None) -> None:
        self.packed, self.registry, self.modules, self.weights = packed, registry, modules, weights
        self.sizes = packed.sizes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.packed(x)
        if self.weights is not None:
            return self.weights.add_delta(x, y, self.registry.batch)
        if len(self.modules) == 1:
            return self.registry.delta_into(self.modules[0], x, y)
        for module, part in zip(self.modules, y.split(self.sizes, dim=-1)):
            self.registry.delta_into(module, x, part)
        return y
