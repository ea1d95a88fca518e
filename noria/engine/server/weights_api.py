"""The weight-update API of the engine server: SGLang's endpoints and Noria's extensions.

SGLang's: ``/update_weights_from_disk``, ``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/update_weights_from_tensor``. Noria's extensions:
``/update_weights_from_ipc`` (a shared-memory segment or CUDA IPC buffer of a process on this
machine, or the engine's own staging area that such a process wrote, see
``/weights_staging_area``), ``update_id`` on it and on ``/update_weights_from_distributed`` (stage
a part only), ``/commit_weights`` and ``/discard_weights`` (apply or drop all parts of one update),
``/weights_info`` (names, dtypes, shapes) and ``/weights_checksum`` (bitwise hashes of the live
weights). ``noria.sync`` is the client; every call goes to the engine's weight component
(``engine.weights``, :mod:`noria.engine.weight_updates`). ``/update_weights_from_disk`` also takes a
weight-delta folder (``sync.delta``, :mod:`noria.engine.weight_delta`): applied to the version served.

Every update is staged, then committed, so a refused or failed one (HTTP 400, naming the tensor or
file) leaves the weights and version as they were. Updates, group joins (a rendezvous that waits for
the trainer, at most ``timeout_s``, default and most ``JOIN_TIMEOUT_S``) and checksums run in a
thread, so ``/health`` and generation keep answering meanwhile.

``/update_weights_from_tensor`` takes JSON, not SGLang's pickled tensors (unpickling a request body
would run arbitrary code)::

    {"named_tensors": [{"name": "model.norm.weight", "dtype": "bfloat16", "shape": [64],
                        "data": "<base64 of the raw little-endian bytes>"},       # or
                       {"name": "lm_head.weight", "dtype": "float32", "shape": [2, 2],
                        "data": [[0.1, 0.2], [0.3, 0.4]]}],                       # nested lists
     "weight_version": 3}

Weights holding NaN or Inf are refused (400).
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

from aiohttp import web

from noria.engine.protocol import RequestError
from noria.engine.server.parsing import is_int, read_json, reject_unknown, want
from noria.engine.weight_sources import JOIN_TIMEOUT_S
from noria.engine.weights import CHECKSUM_ALGOS, dtype_name
from noria.hardware import device_id

if TYPE_CHECKING:
    from noria.engine.server.app import EngineServer


class WeightApi:
    """The weight endpoints over ``server.engine.weights``."""

    def __init__(self, server: EngineServer) -> None:
        self.s = server

    def register(self, router: web.UrlDispatcher) -> None:
        routes = {
            "/update_weights_from_disk": self.update_weights_from_disk,
            "/init_weights_update_group": self.init_weights_update_group,
            "/update_weights_from_distributed": self.update_weights_from_distributed,
            "/update_weights_from_tensor": self.update_weights_from_tensor,
            "/update_weights_from_ipc": self.update_weights_from_ipc,
            "/weights_staging_area": self.weights_staging_area,
            "/commit_weights": self.commit_weights,
            "/discard_weights": self.discard_weights,
            "/weights_info": self.weights_info,
            "/weights_checksum": self.weights_checksum,
        }
        for path, handler in routes.items():
            # SGLang answers GET and POST on most control endpoints; clients use either.
            router.add_route("POST", path, handler)
            router.add_route("GET", path, handler)

    @property
    def weights(self) -> Any:
        return self.s.engine.weights

    def _version(self, body: dict[str, Any]) -> int:
        """``weight_version`` of an update: an int (or SGLang's digit string); default current + 1."""
        value = body.get("weight_version")
        if value is None:
            return int(self.weights.version) + 1
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if not is_int(value):
            raise RequestError(f"weight_version must be an integer, got {value!r}")
        return value

    def _updated(self, message: str) -> web.Response:
        return web.json_response({"success": True, "message": message, "weight_version": self.weights.version})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        reject_unknown(body, {"model_path", "weight_version", "load_format", "abort_all_requests"})
        path = want(body, "model_path", str)
        if not path:
            raise RequestError("model_path: give the folder holding the new weights")
        version = self._version(body)
        try:
            await self.s.blocking(self.weights.update_from_disk, path, version)
        except OSError as e:  # a path the system refuses (too long, not readable): nothing was changed
            raise RequestError(f"model_path: cannot read {path[:200]!r}: {e.strerror or e}") from e
        return self._updated(f"loaded weights from {path}")

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        names = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend", "timeout_s"}
        reject_unknown(body, names)
        timeout_s = want(body, "timeout_s", (int, float), JOIN_TIMEOUT_S)
        if not 0 < timeout_s <= JOIN_TIMEOUT_S:
            raise RequestError(f"timeout_s must be in (0, {JOIN_TIMEOUT_S:g}], got {timeout_s}")
        address = want(body, "master_address", str)
        port, offset, world = (want(body, k, int) for k in ("master_port", "rank_offset", "world_size"))
        if address is None or port is None or offset is None or world is None:
            raise RequestError("master_address, master_port, rank_offset and world_size are required")
        if not 1 <= port <= 65535:
            raise RequestError(f"master_port must be in [1, 65535], got {port}")
        if not 1 <= offset < world:  # the trainer is rank 0 and hosts the store; the engine joins it
            raise RequestError(f"rank_offset must be in [1, world_size) (the trainer is rank 0), got {offset} of {world}")
        group = want(body, "group_name", str, "weight_update_group")
        backend = want(body, "backend", str, "nccl")
        join = self.weights.join_group
        await self.s.blocking(join, address, port, offset, world, group, backend, timeout_s)
        return web.json_response({"success": True, "message": f"joined group {group}"})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """SGLang's fields; with ``update_id`` (a Noria extension) the tensors are only staged, and
        ``/commit_weights`` applies every part of that update at once. ``chunks`` (with
        ``update_id``): counts of consecutive tensors sent as one flat broadcast each, every tensor
        at a 64-byte aligned offset (``weights.flat_offsets``)."""
        body = await read_json(request)
        reject_unknown(body, {"names", "dtypes", "shapes", "group_name", "weight_version", "flush_cache", "update_id", "chunks"})
        names, dtypes, shapes = (want(body, k, list) for k in ("names", "dtypes", "shapes"))
        if names is None or dtypes is None or shapes is None or not len(names) == len(dtypes) == len(shapes):
            raise RequestError("names, dtypes and shapes are required lists of the same length")
        group = want(body, "group_name", str, "weight_update_group")
        update_id, chunks = want(body, "update_id", str), want(body, "chunks", list)
        if update_id:
            n = await self.s.blocking(self.weights.stage_from_distributed, names, dtypes, shapes, group, update_id, chunks)
            return self._staged(update_id, n)
        if chunks is not None:
            raise RequestError("chunks needs an update_id (stage, then /commit_weights)")
        version = self._version(body)
        await self.s.blocking(self.weights.update_from_distributed, names, dtypes, shapes, version, group)
        return self._updated(f"received {len(names)} tensor(s) over {group}")

    async def update_weights_from_ipc(self, request: web.Request) -> web.Response:
        """Tensors in a shared-memory segment (``{"kind": "shm", "name", "size"}``) or a CUDA IPC
        buffer of a process on this machine, located by ``tensors: [{name, dtype, shape, offset}]``.
        With ``update_id`` they are staged only (see ``/commit_weights``)."""
        body = await read_json(request)
        reject_unknown(body, {"handle", "tensors", "update_id", "weight_version"})
        handle, tensors = want(body, "handle", dict), want(body, "tensors", list)
        if handle is None or not tensors:
            raise RequestError("handle (an object) and tensors (a non-empty list) are required")
        update_id = want(body, "update_id", str)
        if update_id:
            n = await self.s.blocking(self.weights.stage_from_ipc, handle, tensors, update_id)
            return self._staged(update_id, n)
        version = self._version(body)
        await self.s.blocking(self.weights.update_from_ipc, handle, tensors, version)
        return self._updated(f"copied {len(tensors)} tensor(s) from {handle.get('kind')} ipc")

    async def weights_staging_area(self, request: web.Request) -> web.Response:
        """Begin update ``update_id`` with its staging buffers in a memfd a process on this machine
        can map (``/proc/<pid>/fd/<fd>``) and write; then ``/update_weights_from_ipc`` with
        ``{"kind": "staging"}`` names what was written, and ``/commit_weights`` applies it."""
        body = await read_json(request)
        reject_unknown(body, {"update_id"})
        update_id = want(body, "update_id", str)
        if not update_id:
            raise RequestError("update_id: give the id of the update to stage")
        return web.json_response(await self.s.blocking(self.weights.staging_area, update_id))

    async def commit_weights(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        reject_unknown(body, {"update_id", "weight_version"})
        update_id = want(body, "update_id", str)
        if not update_id:
            raise RequestError("update_id: give the id the update's parts were staged under")
        version = self._version(body)
        changed = await self.s.blocking(self.weights.commit, update_id, version)
        return self._updated(f"committed update {update_id}: {len(changed)} parameter(s)")

    async def discard_weights(self, request: web.Request) -> web.Response:
        body = await read_json(request, required=False)
        reject_unknown(body, {"update_id"})
        dropped = await self.s.blocking(self.weights.discard, want(body, "update_id", str))
        return web.json_response({"success": True, "discarded": dropped})

    def _staged(self, update_id: str, n: int) -> web.Response:
        return web.json_response({
            "success": True, "message": f"staged {n} tensor(s) for update {update_id}", "update_id": update_id,
            "weight_version": self.weights.version,
        })  # fmt: skip

    async def weights_info(self, request: web.Request) -> web.Response:
        """Every tensor an update may name, with dtype and shape; checksum algorithms on offer."""
        specs = self.weights.specs()
        return web.json_response({
            "tensors": {n: {"dtype": dtype_name(d), "shape": list(shape)} for n, (d, shape) in specs.items()},
            "checksum_algos": list(CHECKSUM_ALGOS),
            "device": str(getattr(self.s.engine, "device", "cpu")),
            "device_id": device_id(getattr(self.s.engine, "device", "cpu")),
            "weight_version": self.weights.version,
        })  # fmt: skip

    async def weights_checksum(self, request: web.Request) -> web.Response:
        """``{"checksums": {name: hex}}`` of the live weights; ``names`` (a JSON list, or a
        comma-separated query parameter) limits them, ``algo`` picks the hash (default sha256)."""
        body = await read_json(request, required=False)
        reject_unknown(body, {"names", "algo"})
        names = want(body, "names", list)
        if names is None and request.query.get("names"):
            names = request.query["names"].split(",")
        if names is not None and not all(isinstance(n, str) for n in names):
            raise RequestError("names must be a list of tensor names (strings)")
        algo = want(body, "algo", str) or request.query.get("algo", "sha256")
        sums = await self.s.blocking(self.weights.checksums, names, algo)
        return web.json_response({"algo": algo, "checksums": sums, "weight_version": self.weights.version})

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        if "serialized_named_tensors" in body:
            raise RequestError("serialized_named_tensors (pickled) is not accepted; send named_tensors as JSON")
        reject_unknown(body, {"named_tensors", "weight_version", "flush_cache", "load_format"})
        tensors = decode_named_tensors(body.get("named_tensors"))
        check_finite(tensors)
        version = self._version(body)
        await self.s.blocking(self.weights.update_from_state_dict, tensors, version)
        return self._updated(f"updated {len(tensors)} tensor(s)")


# ------------------------------------------------------------------------------- tensor decoding

_DTYPES = {"float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool"}


def decode_named_tensors(items: Any) -> list[tuple[str, Any]]:
    """``named_tensors`` JSON (see the module docstring) -> [(name, torch.Tensor)]."""
    import torch

    if not isinstance(items, list) or not items:
        raise RequestError("named_tensors must be a non-empty list of {name, dtype, shape, data}")
    out = []
    for i, item in enumerate(items):
        where = f"named_tensors[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object with name, dtype, shape, data")
        reject_unknown(item, {"name", "dtype", "shape", "data"}, f"{where}: ")
        name, dtype, shape = item.get("name"), item.get("dtype", "float32"), item.get("shape")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{where}.name must be a non-empty string")
        if dtype not in _DTYPES:
            raise RequestError(f"{where}.dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise RequestError(f"{where}.shape must be a list of non-negative integers")
        out.append((name, _tensor(item.get("data"), getattr(torch, dtype), shape, where)))
    return out


def check_finite(tensors: list[tuple[str, Any]]) -> None:
    """RequestError naming the first tensor holding NaN or Inf (weights an engine must never serve)."""
    for name, t in tensors:
        if t.is_floating_point() and not bool(t.isfinite().all()):
            raise RequestError(f"named_tensors: {name!r} holds non-finite values (NaN or Inf); refused")


def _tensor(data: Any, dtype: Any, shape: list[int], where: str) -> Any:
    import torch

    try:
        if isinstance(data, str):
            raw = bytearray(base64.b64decode(data, validate=True))
            tensor = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        elif isinstance(data, (list, int, float)):
            tensor = torch.tensor(data, dtype=dtype)
        else:
            raise RequestError(f"{where}.data must be base64 text or nested lists of numbers")
        return tensor.reshape(shape)
    except (ValueError, RuntimeError, TypeError) as e:
        raise RequestError(f"{where}.data does not match dtype and shape {shape}: {e}") from e
