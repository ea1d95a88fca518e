"""Tinker's JSON records, read and written: ``Datum``, ``ModelInput``, ``TensorData``.

A datum, as Tinker's SDK models it::

    {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
     "loss_fn_inputs": {"target_tokens": {"data": [2, 3, 4], "dtype": "int64", "shape": [3]},
                        "weights": {"data": [0, 1, 1], "dtype": "float32", "shape": [3]}}}

``target_tokens[i]`` is the token predicted at input position ``i`` (so it is the input shifted by
one), and every loss input has one value per input position. A ``TensorData`` may also be sent as a
plain list. Only 1-D dense tensors and text chunks are read: image chunks and sparse tensors are
refused with the field named. Every error names the datum's index and the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from noria.errors import NoriaError

FLOAT_INPUTS = ("weights", "advantages", "logprobs")
"""Loss inputs read as float32 (``logprobs``: the sampler's logprobs of the targets)."""


class BadRequest(NoriaError):
    """A request whose body does not follow the API: HTTP 400 with this message."""


@dataclass
class Datum:
    """One sequence: input tokens [T] and its loss inputs, each [T]."""

    tokens: list[int]
    targets: torch.Tensor
    inputs: dict[str, torch.Tensor]


def read_tokens(model_input: object, where: str, vocab: int) -> list[int]:
    """The token ids of a ``ModelInput`` (its text chunks, in order)."""
    if not isinstance(model_input, dict) or not isinstance(model_input.get("chunks"), list):
        raise BadRequest(f"{where}: needs {{'chunks': [{{'type': 'encoded_text', 'tokens': [...]}}]}}")
    tokens: list[int] = []
    for j, chunk in enumerate(model_input["chunks"]):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text" or not isinstance(chunk.get("tokens"), list):
            raise BadRequest(f"{where}.chunks[{j}]: only encoded_text chunks with a 'tokens' list are supported, got {kind!r}")
        tokens += chunk["tokens"]
    _check_ids(tokens, f"{where}.chunks", vocab)
    if not tokens:
        raise BadRequest(f"{where}: no tokens")
    return tokens


def _check_ids(ids: list, where: str, vocab: int) -> None:
    bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequest(f"{where}: token id {bad!r} is not an integer in [0, {vocab})")


def read_tensor(value: object, where: str, length: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D ``TensorData`` (or plain list) of ``length`` values; floats must be finite."""
    if isinstance(value, dict):
        if value.get("sparse_crow_indices") is not None:
            raise BadRequest(f"{where}: sparse tensors are not supported")
        shape = value.get("shape")
        value = value.get("data")
        if shape is not None and list(shape) != [length]:
            raise BadRequest(f"{where}: shape {shape}, the input has {length} tokens")
    if not isinstance(value, list) or len(value) != length:
        raise BadRequest(f"{where}: needs {length} values (one per input token), got {len(value) if isinstance(value, list) else type(value).__name__}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise BadRequest(f"{where}: values must be numbers")
    if dtype.is_floating_point:
        bad = next((i for i, v in enumerate(value) if not math.isfinite(v)), None)
        if bad is not None:
            raise BadRequest(f"{where}[{bad}]: {value[bad]} is not finite")
    return torch.tensor(value, dtype=dtype)


def read_data(data: object, vocab: int, needs: tuple[str, ...]) -> list[Datum]:
    """The ``data`` list of a forward / forward_backward input; ``needs``: loss inputs it must have."""
    if not isinstance(data, list) or not data:
        raise BadRequest("forward_backward_input.data: needs a non-empty list of datums")
    out = []
    for i, d in enumerate(data):
        where = f"data[{i}]"
        if not isinstance(d, dict):
            raise BadRequest(f"{where}: needs a datum object")
        tokens = read_tokens(d.get("model_input"), f"{where}.model_input", vocab)
        raw = d.get("loss_fn_inputs") or {}
        unknown = sorted(set(raw) - {"target_tokens", *FLOAT_INPUTS})
        if unknown:
            raise BadRequest(f"{where}.loss_fn_inputs: unknown inputs {unknown}; known: target_tokens, {', '.join(FLOAT_INPUTS)}")
        missing = [k for k in ("target_tokens", *needs) if k not in raw]
        if missing:
            raise BadRequest(f"{where}.loss_fn_inputs: this loss needs {missing}")
        targets = read_tensor(raw["target_tokens"], f"{where}.loss_fn_inputs.target_tokens", len(tokens), torch.int64)
        _check_ids(targets.tolist(), f"{where}.loss_fn_inputs.target_tokens", vocab)
        inputs = {k: read_tensor(raw[k], f"{where}.loss_fn_inputs.{k}", len(tokens), torch.float32) for k in FLOAT_INPUTS if k in raw}
        out.append(Datum(tokens=tokens, targets=targets, inputs=inputs))
    return out


def tensor_data(values: torch.Tensor) -> dict:
    """A 1-D float tensor as Tinker's ``TensorData``."""
    flat = values.detach().float().cpu()
    return {"data": flat.tolist(), "dtype": "float32", "shape": list(flat.shape)}
