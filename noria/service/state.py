"""Saved adapters: training state (weights + optimizer) and sampler weights, behind tinker:// paths.

Layout, under ``service.state_dir``::

    <tenant>/<model_id>/weights/<name>/           save_state: the training state
        adapter.safetensors                         the adapter's parameters, as in memory
        optimizer.pt                                its AdamW state_dict (weights_only loadable)
        meta.json                                   spec (rank, alpha, targets, seed), steps, base model
    <tenant>/<model_id>/sampler_weights/<name>/   save_weights_for_sampler: a peft adapter folder

A path is ``tinker://<model_id>/weights/<name>`` (or ``/sampler_weights/``) as Tinker names them;
it is resolved under the CALLING tenant's folder only, so another tenant's path is not found (404),
and names are restricted to ``[A-Za-z0-9._-]`` (no ``..``). Each file is written to a temporary
name and renamed, so a crash leaves the last complete save. A saved state outlives the service: a
restarted service loads it into a new training client of the same spec (``load_state``), and the
weights and optimizer state come back bit for bit.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from noria.errors import NoriaError
from noria.service.adapters import Adapter, AdapterSpec

SCHEME = "tinker://"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
KINDS = ("weights", "sampler_weights")


class NotFound(NoriaError):
    """A model, future or path the calling tenant does not have: HTTP 404."""


def check_name(name: object, field: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise NoriaError(f"{field}: {name!r} is not a name of letters, digits, '.', '_' or '-' (at most 128)")
    return name


def folder_of(state_dir: Path, tenant: str, path: str) -> tuple[Path, str, str]:
    """(folder, model_id, kind) of a tinker:// path of ``tenant``; ``NotFound`` if it is not there."""
    if not isinstance(path, str) or not path.startswith(SCHEME):
        raise NoriaError(f"path: {path!r} is not a {SCHEME}<model_id>/weights/<name> path")
    parts = path[len(SCHEME):].split("/")
    if len(parts) != 3 or parts[1] not in KINDS:
        raise NoriaError(f"path: {path!r} is not a {SCHEME}<model_id>/(weights|sampler_weights)/<name> path")
    model_id, kind, name = check_name(parts[0], "path model_id"), parts[1], check_name(parts[2], "path name")
    folder = state_dir / tenant / model_id / kind / name
    if not folder.is_dir():
        raise NotFound(f"path {path}: no such saved state")
    return folder, model_id, kind


def save_state(adapter: Adapter, folder: Path, base_model: str) -> None:
    """The adapter's parameters, optimizer state and spec into ``folder``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    _atomic(folder / "adapter.safetensors", lambda p: save_file({n: t.detach().contiguous() for n, t in _portable(adapter).items()}, str(p)))
    _atomic(folder / "optimizer.pt", lambda p: torch.save(adapter.optimizer.state_dict(), p))
    meta = {"spec": {**adapter.spec.__dict__, "target_modules": list(adapter.spec.target_modules)}, "steps": adapter.steps, "base_model": base_model}
    _atomic(folder / "meta.json", lambda p: p.write_text(json.dumps(meta, indent=1)))


def _portable(adapter: Adapter) -> dict[str, torch.Tensor]:
    """Parameter names without the adapter's own name, so a state loads into any adapter."""
    return {n.replace(f".{adapter.name}.", ".ADAPTER."): p for n, p in adapter.params.items()}


def read_spec(folder: Path) -> tuple[AdapterSpec, int, str]:
    """The spec, step count and base model a saved state was made with."""
    meta = json.loads((folder / "meta.json").read_text())
    s = meta["spec"]
    return AdapterSpec(rank=s["rank"], alpha=s["alpha"], target_modules=tuple(s["target_modules"]), seed=s["seed"]), meta["steps"], meta["base_model"]


def load_state(adapter: Adapter, folder: Path, with_optimizer: bool) -> None:
    """Weights (and, if asked, the optimizer state) of a saved state into ``adapter``, which must
    have the same rank, alpha and target modules; pending gradients are dropped."""
    from safetensors.torch import load_file

    spec, steps, _ = read_spec(folder)
    mine = (adapter.spec.rank, adapter.spec.alpha, sorted(adapter.spec.target_modules))
    saved = (spec.rank, spec.alpha, sorted(spec.target_modules))
    if mine != saved:
        raise NoriaError(f"load_state {folder.name}: saved (rank, alpha, targets) {saved}, this training client has {mine}")
    tensors = load_file(str(folder / "adapter.safetensors"))
    names = _portable(adapter)
    if set(tensors) != set(names):
        raise NoriaError(f"load_state {folder.name}: the saved adapter's tensors do not match this model's layers")
    with torch.no_grad():
        for n, p in names.items():
            p.copy_(tensors[n])
            p.grad = None
    adapter.grad_calls = 0
    adapter.version += 1
    if with_optimizer:
        adapter.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True, map_location=adapter.optimizer.param_groups[0]["params"][0].device))
        adapter.steps = steps


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)
