"""Many LoRA adapters on one base model: the engine's adapter registry.

An adapter is a set of low-rank pairs (A [r, K], B [N, r]) on some of the decoder blocks' linear
layers, with peft's scaling ``alpha / r``: a targeted layer computes ``W x + scaling * B A x``. The
registry keeps every loaded adapter in a *slot*; per targeted layer it holds one stack of every
slot's A and one of every slot's B (``noria.engine.lora_ops.LoraStack``), so that one step serves
rows of many adapters (and base rows) together: each row gets its own adapter's delta
(``lora_ops`` says how, and what was measured).

Sources (``Engine.load_adapter``): a peft adapter folder (``adapter_config.json`` +
``adapter_model.safetensors``, what ``noria.train.lora.save_adapter`` writes), or tensors with
peft's names (``base_model.model.<module>.lora_A.weight``; the in-memory ``.lora_A.default.weight``
is accepted too) and peft's config dict (``r``, ``lora_alpha``, ``target_modules``). Refused with
a message naming the adapter: DoRA, rsLoRA, per-module rank or alpha patterns, a module that is
not a linear layer of a decoder block, shapes that do not fit the module, non-finite values (a
NaN in one adapter's B would reach every row of the step through the stacked matmul's zeros).

Lifecycle. ``install`` puts an adapter in a free slot, or in the least-recently-used slot that no
request holds (eviction); with every slot held it raises :class:`AdapterError`. ``update`` copies
new tensors into the adapter's slot in place and sets its version (adapter-only sync); requests
running on it continue with the new weights from the next step. A request pins its adapter from
admission to its end (``pin`` / ``unpin``): a pinned adapter is never evicted, and unloading it
is refused. Each install and update takes a fresh ``key``, the adapter's prefix-cache namespace
(``noria.engine.radix``): KV computed with one adapter (or one version of it) is never served to
another, nor to the base model.

Memory. Stacks are made for a layer when the first adapter targeting it arrives, with
``engine.lora_max_adapters`` slots and the rank of the largest adapter loaded (grown, never
shrunk); an adapter of lower rank is zero-padded, which leaves its delta exactly the same. A load
that would grow them past ``engine.lora_max_memory_mb`` is refused.

Threads: every mutation runs on the engine thread between steps (the engine posts them); the
forward reads the stacks and :attr:`LoraRegistry.batch` on that thread too. ``names`` is read from
callers' threads (a dict copy, for validation only).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from noria.engine.lora_ops import GROUPS, GroupWeights, LoraBatch, LoraStack
from noria.engine.protocol import RequestError
from noria.models.decoder import DecoderLM, Linear

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""The two files of a peft adapter folder (``noria.train.lora.save_adapter`` writes the same)."""
_PEFT_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


class AdapterError(RequestError):
    """An adapter cannot be loaded, updated or unloaded (HTTP 400); the message names it and why."""


@dataclass
class Adapter:
    """One loaded adapter (engine-thread state)."""

    name: str
    slot: int
    rank: int
    scaling: float
    modules: tuple[str, ...]
    version: int = 0
    key: int = 0
    """The prefix-cache namespace of this load or update (new at each)."""
    last_used: float = field(default_factory=time.time)
    pins: int = 0
    """Requests holding the adapter (admitted or waiting): never evicted while > 0."""

    def info(self) -> dict[str, Any]:
        return {"version": self.version, "rank": self.rank, "scaling": self.scaling, "slot": self.slot,
                "last_used": self.last_used, "in_use": self.pins, "modules": len(self.modules)}  # fmt: skip


@dataclass
class ParsedAdapter:
    """An adapter's tensors per module, checked against the model: {module: (A [r, K], B [N, r])}."""

    rank: int
    scaling: float
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_folder(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and config of a peft adapter folder."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise AdapterError(f"{folder}: a LoRA adapter folder needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} (peft's format)")
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{folder / ADAPTER_CONFIG}: not JSON ({e})") from None
    return load_file(str(folder / ADAPTER_WEIGHTS)), config


def lora_modules(model: DecoderLM) -> dict[str, Linear]:
    """The linear layers of the decoder blocks an adapter may target, by module name."""
    return {name: m for name, m in model.model.layers.named_modules(prefix="model.layers") if isinstance(m, Linear)}


def parse_adapter(
    name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any], modules: dict[str, Linear]
) -> ParsedAdapter:
    """Check peft-named ``tensors`` and peft's ``config`` against the model's ``modules``."""
    config = config or {}
    for key in ("use_dora", "use_rslora"):
        if config.get(key):
            raise AdapterError(f"adapter {name!r}: {key} is not supported by the engine")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise AdapterError(f"adapter {name!r}: per-module {key} is not supported by the engine")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"adapter {name!r}: config r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"adapter {name!r}: config lora_alpha must be a number, got {alpha!r}")
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for tname, t in tensors.items():
        m = _PEFT_NAME.match(tname)
        if m is None:
            raise AdapterError(f"adapter {name!r}: tensor {tname!r} is not a peft LoRA name (<module>.lora_A.weight)")
        halves.setdefault(m["module"], {})[m["ab"]] = t
    if not halves:
        raise AdapterError(f"adapter {name!r}: no LoRA tensors")
    pairs = {}
    for module, ab in sorted(halves.items()):
        pairs[module] = _check_pair(name, module, ab, rank, modules)
    return ParsedAdapter(rank=rank, scaling=float(alpha) / rank, pairs=pairs)


def _check_pair(name: str, module: str, ab: dict[str, torch.Tensor], rank: int, modules: dict[str, Linear]):
    if module not in modules:
        raise AdapterError(
            f"adapter {name!r}: module {module!r} is not a linear layer of a decoder block of this model "
            f"(e.g. {next(iter(modules), '?')!r})"
        )
    if set(ab) != {"A", "B"}:
        raise AdapterError(f"adapter {name!r}: module {module!r} has lora_{'A' if 'A' in ab else 'B'} only")
    layer, a, b = modules[module], ab["A"], ab["B"]
    want_a, want_b = (rank, layer.in_features), (layer.out_features, rank)
    if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
        raise AdapterError(
            f"adapter {name!r}: module {module!r} has A {tuple(a.shape)} and B {tuple(b.shape)}, the model needs "
            f"A {want_a} and B {want_b} (rank {rank})"
        )
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise AdapterError(f"adapter {name!r}: module {module!r} has non-finite values")
    return a, b


class LoraRegistry:
    """The loaded adapters, their slots and the per-layer stacks; see the module docstring."""

    def __init__(self, model: DecoderLM, max_adapters: int, deterministic: bool = False, max_memory_mb: float | None = None) -> None:
        first = next(model.parameters())
        self.model = model
        self.dtype, self.device = first.dtype, first.device
        self.capacity = max_adapters
        self.deterministic = deterministic
        self.max_memory_mb = max_memory_mb
        self.modules = lora_modules(model)
        self.stacks: dict[str, LoraStack] = {}
        self.adapters: dict[str, Adapter] = {}
        self.names: dict[str, int] = {}
        """name -> version, replaced (never mutated) on every change: read by other threads."""
        self.rank = 0
        """The stacks' rank: the largest adapter's."""
        self.batch: LoraBatch | None = None
        """The current forward's row -> slot mapping (set by the runner around a forward with adapter rows)."""
        self._next_key = 1
        self._groups: dict[tuple[int, str], GroupWeights | None] = {}
        """The fast decoder's group weights for the current ``hi`` (``lora_ops.GroupWeights``), dropped at every change."""
        self._groups_hi = 0
        self._relayout = False
        """Stacks were made or widened since the group weights were: they are made again."""

    # ------------------------------------------------------------------------------ lifecycle

    def install(self, name: str, parsed: ParsedAdapter, version: int = 0) -> Adapter:
        """Load (or replace, when not in use) adapter ``name`` into a slot."""
        old = self.adapters.get(name)
        if old is not None:
            if old.pins:
                raise AdapterError(f"adapter {name!r} is in use by {old.pins} request(s): update it in place instead")
            slot = old.slot
            del self.adapters[name]
        else:
            self._check_memory(name, parsed)
            slot = self._free_slot(name)
        self._grow(parsed.rank)
        for stack in self.stacks.values():
            stack.clear(slot)
        adapter = Adapter(name, slot, parsed.rank, parsed.scaling, tuple(parsed.pairs), version, self._take_key())
        self._write(adapter, parsed)
        self.adapters[name] = adapter
        self._publish(slot)
        return adapter

    def update(self, name: str, parsed: ParsedAdapter, version: int) -> Adapter:
        """New weights for a loaded adapter, in place (same rank, scaling and modules)."""
        adapter = self.get(name)
        if parsed.rank != adapter.rank or set(parsed.pairs) != set(adapter.modules):
            raise AdapterError(
                f"adapter {name!r}: an update must keep rank {adapter.rank} and its {len(adapter.modules)} modules "
                f"(got rank {parsed.rank}, {len(parsed.pairs)} modules); load it again instead"
            )
        adapter.scaling = parsed.scaling
        self._write(adapter, parsed)
        adapter.version = version
        adapter.key = self._take_key()
        self._publish(adapter.slot)
        return adapter

    def unload(self, name: str) -> None:
        adapter = self.get(name)
        if adapter.pins:
            raise AdapterError(f"adapter {name!r} is in use by {adapter.pins} request(s); unload it when they end")
        for stack in self.stacks.values():
            stack.clear(adapter.slot)
        del self.adapters[name]
        self._publish(adapter.slot)

    def get(self, name: str) -> Adapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise AdapterError(f"unknown adapter {name!r}; loaded: {sorted(self.adapters)}")
        return adapter

    def pin(self, name: str) -> Adapter:
        adapter = self.get(name)
        adapter.pins += 1
        adapter.last_used = time.time()
        return adapter

    @staticmethod
    def unpin(adapter: Adapter) -> None:
        adapter.pins -= 1
        adapter.last_used = time.time()

    def info(self) -> dict[str, dict[str, Any]]:
        return {name: a.info() for name, a in sorted(self.adapters.items())}

    # ------------------------------------------------------------------------------ forward

    def begin(self, slots: list[int]) -> bool:
        """Set the row -> slot mapping of the next forward (``slots``: one per flattened token, -1
        for base rows); False (and nothing set) when no row has an adapter."""
        if all(s < 0 for s in slots):
            return False
        scaling = [0.0] * self.capacity
        for a in self.adapters.values():
            scaling[a.slot] = a.scaling
        self.batch = LoraBatch.build(slots, scaling, self.rank, self.capacity, self.dtype, self.device, self.deterministic)
        return True

    def end(self) -> None:
        self.batch = None

    def delta_into(self, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus the current batch's LoRA delta of ``module`` for input ``x`` (``y`` as is when
        no forward with adapter rows is running or no adapter targets the module)."""
        stack = self.stacks.get(module)
        if self.batch is None or stack is None:
            return y
        return stack.add_delta(x, y, self.batch)

    # ------------------------------------------------------------------------------ internals

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's stacks."""
        return sum(s.nbytes for s in self.stacks.values())

    def _check_memory(self, name: str, parsed: ParsedAdapter) -> None:
        """``engine.lora_max_memory_mb``: refuse a load that would grow the stacks past it."""
        if self.max_memory_mb is None:
            return
        rank = max(self.rank, parsed.rank)
        modules = set(self.stacks) | set(parsed.pairs)
        size = torch.empty((), dtype=self.dtype).element_size()
        need = sum(self.capacity * rank * (self.modules[m].in_features + self.modules[m].out_features) * size for m in modules)
        if need > self.max_memory_mb * 2**20:
            raise AdapterError(
                f"cannot load adapter {name!r}: the LoRA slots would take {need / 2**20:.1f} MB (rank {rank}, "
                f"{len(modules)} layers, {self.capacity} slots), over engine.lora_max_memory_mb={self.max_memory_mb}"
            )

    def _free_slot(self, name: str) -> int:
        used = {a.slot for a in self.adapters.values()}
        free = [s for s in range(self.capacity) if s not in used]
        if free:
            return free[0]
        idle = [a for a in self.adapters.values() if a.pins == 0]
        if not idle:
            raise AdapterError(
                f"cannot load adapter {name!r}: all {self.capacity} slots (engine.lora_max_adapters) hold adapters in "
                f"use by running requests ({sorted(self.adapters)})"
            )
        victim = min(idle, key=lambda a: a.last_used)
        del self.adapters[victim.name]
        for stack in self.stacks.values():
            stack.clear(victim.slot)
        return victim.slot

    def _grow(self, rank: int) -> None:
        if rank > self.rank:
            self.rank = rank
            self._relayout = True
            for stack in self.stacks.values():
                stack.grow(rank)

    def _write(self, adapter: Adapter, parsed: ParsedAdapter) -> None:
        for module, (a, b) in parsed.pairs.items():
            stack = self.stacks.get(module)
            if stack is None:
                layer = self.modules[module]
                stack = LoraStack(layer.in_features, layer.out_features, self.capacity, self.rank, self.dtype, self.device)
                self.stacks[module] = stack
                self._relayout = True
                layer.lora = _Hook(self, module)
            stack.write(adapter.slot, a, b)

    def _take_key(self) -> int:
        key, self._next_key = self._next_key, self._next_key + 1
        return key

    def _publish(self, slot: int) -> None:
        """After a change of ``slot``: the names other threads read, and the group weights."""
        self.names = {n: a.version for n, a in self.adapters.items()}
        if self._relayout:
            self._groups.clear()
            self._relayout = False
        for weights in self._groups.values():
            if weights is not None:
                weights.refresh(slot)

    def group_weights(self, layer: int, kind: str, sizes: list[int]) -> GroupWeights | None:
        """The current batch's :class:`GroupWeights` of fast-decoder matmul ``kind`` of ``layer``
        (None when no adapter targets its modules), made on first use after a change."""
        hi = self.batch.hi
        if hi != self._groups_hi:
            self._groups.clear()
            self._groups_hi = hi
        key = (layer, kind)
        if key not in self._groups:
            stacks = [self.stacks.get(f"model.layers.{layer}.{m}") for m in GROUPS[kind]]
            made = None
            if any(s is not None for s in stacks):
                made = GroupWeights(stacks, sizes, hi, self.rank)
            self._groups[key] = made
        return self._groups[key]


class _Hook:
    """``Linear.lora`` of a targeted layer: adds the current batch's delta to the layer's output."""

    def __init__(self, registry: LoraRegistry, module: str) -> None:
        self.registry, self.module = registry, module

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.registry.delta_into(self.module, x, y)
