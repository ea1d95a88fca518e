"""Weight updates of a running engine: validation, the broadcast group, and the copy itself.

Three sources, one rule: names and shapes are checked against the model BEFORE any parameter is
touched, so a bad update raises and leaves the old weights (and version) in place. Sources:

- a state dict (HF names; a subset is fine) from the same process;
- a safetensors folder (HF layout; validated from file headers, tensors read during the copy);
- a torch.distributed broadcast from rank 0 of a group made by :func:`create_update_group`. The
  trainer side calls the same function with ``rank=0`` (it hosts the rendezvous store). The group
  is standalone (its own store and backend object), so it never touches a default process group
  the host process may already have.

Blocking: :func:`receive_broadcast` blocks until rank 0 has sent every tensor; group creation
blocks until all ``world_size`` ranks have joined. Copies (:func:`copy_into`) are the caller's to
schedule between engine steps.
Not guaranteed: an I/O error in the middle of a disk update leaves a mix of old and new tensors
(shapes are validated first; contents are not checksummed here).
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from noria.errors import NoriaError
from noria.models.checkpoint import tensor_files


class WeightUpdateError(NoriaError):
    """A weight update names an unknown tensor or has a wrong shape; nothing was changed."""


def check_shapes(model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise :class:`WeightUpdateError` unless every name is a parameter of that shape."""
    if not shapes:
        raise WeightUpdateError("weight update holds no tensors")
    params = model.state_dict()
    for name, shape in shapes.items():
        if name not in params:
            raise WeightUpdateError(f"weight update: unknown tensor '{name}' (not a model parameter)")
        if tuple(shape) != tuple(params[name].shape):
            raise WeightUpdateError(
                f"weight update: tensor '{name}' has shape {tuple(shape)}, the model's is {tuple(params[name].shape)}"
            )


@torch.no_grad()
def copy_into(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy (with dtype/device conversion) into the named parameters; call check_shapes first."""
    params = model.state_dict()
    for name, tensor in tensors.items():
        params[name].copy_(tensor)


def folder_files(folder: str | Path) -> dict[str, Path]:
    """Map tensor name -> file of a safetensors folder (single file or sharded index)."""
    try:
        return tensor_files(folder)
    except FileNotFoundError as e:
        raise WeightUpdateError(f"weight update from disk: {e}") from e


def check_folder(model: nn.Module, files: dict[str, Path]) -> None:
    """Validate a folder's tensors from their headers alone (no data read)."""
    shapes = {}
    for f in sorted(set(files.values())):
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                if files.get(name) == f:
                    shapes[name] = tuple(sf.get_slice(name).get_shape())
    check_shapes(model, shapes)


@torch.no_grad()
def copy_from_folder(model: nn.Module, files: dict[str, Path]) -> None:
    """Read each tensor and copy it in, one at a time (peak memory: one tensor)."""
    params = model.state_dict()
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with safe_open(f, framework="pt") as sf:
            for name in names:
                params[name].copy_(sf.get_tensor(name))


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"weight update: unknown dtype {name!r}")
    return dtype


def create_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 300.0,
):
    """A standalone process group; rank 0 hosts the TCP store. Blocks until all ranks join."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    raise WeightUpdateError(f"weight update group: backend must be gloo or nccl, got {backend!r}")


def receive_broadcast(
    group, names: list[str], dtypes: list, shapes: list, device: torch.device
) -> dict[str, torch.Tensor]:
    """Receive each named tensor from rank 0, in order, into new buffers (the model is untouched)."""
    out = {}
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        buf = torch.empty(tuple(shape), dtype=parse_dtype(dtype), device=device)
        group.broadcast(buf, 0).wait()
        out[name] = buf
    return out


def send_broadcast(group, tensors: dict[str, torch.Tensor]) -> None:
    """The rank-0 side of :func:`receive_broadcast` (trainers and tests call this)."""
    for tensor in tensors.values():
        group.broadcast(tensor.contiguous(), 0).wait()
