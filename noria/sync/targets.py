"""The engines a weight sync pushes to: an in-process ``Engine`` or an engine server over HTTP.

A target is given to :func:`noria.sync.build_sync` as an ``noria.engine.Engine`` object (wrapped
in :class:`LocalTarget`), an :class:`HttpEngine`, or a URL string (``"http://127.0.0.1:30000"``,
made into an ``HttpEngine`` without an API key). Both kinds answer the same calls, which the
transports use:

=====================  ===================================  ======================================
call                   in process (``engine.weights.*``)    HTTP (noria serve; * = Noria extension)
=====================  ===================================  ======================================
``specs``              ``specs``                            ``GET /weights_info`` *
``version``            ``version``                          ``GET /get_weight_version``
``checksums``          ``checksums``                        ``POST /weights_checksum`` *
``stage``              ``stage``                            (in process only)
``stage_ipc``          ``stage_from_ipc``                   ``POST /update_weights_from_ipc`` *
``staging_area``       (in process: not needed)             ``POST /weights_staging_area`` *
``join_group``         ``join_group``                       ``POST /init_weights_update_group``
``stage_broadcast``    ``stage_from_distributed``           ``POST /update_weights_from_distributed``
                                                            with ``update_id`` *
``load_disk``          ``update_from_disk``                 ``POST /update_weights_from_disk``
``commit`` / discard   ``commit`` / ``discard``             ``POST /commit_weights`` * / ``/discard_weights`` *
=====================  ===================================  ======================================

An external SGLang server answers only the SGLang calls: ``load_disk`` and ``version`` (so the
disk transport, without verification); a vLLM server is a :class:`noria.sync.vllm.VllmEngine`. Every failure is raised as a
:class:`WeightSyncError` naming the engine (``local[i]`` or its URL) and what the engine said.

Blocking: every call blocks its caller (HTTP calls have no read timeout beyond
:data:`HTTP_TIMEOUT_S`: a large update takes as long as it takes); the transports run calls to
several engines on threads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from noria.errors import NoriaError
from noria.sync.errors import WeightSyncError

HTTP_TIMEOUT_S = 900.0
"""Longest a single weight-update call to an engine server may take."""


@dataclass(frozen=True)
class Specs:
    """What an engine says about its weights."""

    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    """Every name an update may carry, with the engine's dtype and shape."""
    checksum_algos: tuple[str, ...]
    """Checksum algorithms the engine computes (see ``noria.engine.weights.tensor_checksum``)."""
    device: str
    """Where the engine's weights live (``cpu``, ``cuda:0``)."""
    device_id: str | None = None
    """The engine's CUDA device UUID (``noria.hardware.device_id``); None on the CPU or when not said."""


class LocalTarget:
    """An ``Engine`` in this process."""

    def __init__(self, engine: Any, name: str) -> None:
        self.engine = engine
        self.name = name

    @property
    def weights(self) -> Any:
        """The engine's weight component (``noria.engine.weight_updates.WeightUpdates``)."""
        return self.engine.weights

    def specs(self) -> Specs | None:
        from noria.engine.weights import CHECKSUM_ALGOS

        from noria.hardware import device_id

        return Specs(self.weights.specs(), CHECKSUM_ALGOS, str(self.engine.device), device_id(self.engine.device))

    def version(self) -> int:
        return self.weights.version

    def checksums(self, names: list[str], algo: str) -> dict[str, str]:
        return self._call(self.weights.checksums, names, algo)

    def stage(self, bucket: list[tuple[str, torch.Tensor]], update_id: str) -> None:
        self._call(self.weights.stage, bucket, update_id)

    def stage_ipc(self, handle: dict[str, Any], tensors: list[dict[str, Any]], update_id: str) -> None:
        self._call(self.weights.stage_from_ipc, handle, tensors, update_id)

    def join_group(self, address: str, port: int, rank: int, world_size: int, group: str, backend: str) -> None:
        self._call(self.weights.join_group, address, port, rank, world_size, group, backend)

    def leave_group(self, group: str) -> None:
        self.weights.leave_group(group)

    def stage_broadcast(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group: str, update_id: str,
                        chunks: list[int] | None = None) -> None:  # fmt: skip
        self._call(self.weights.stage_from_distributed, names, dtypes, shapes, group, update_id, chunks)

    def load_disk(self, folder: Path, version: int) -> None:
        self._call(self.weights.update_from_disk, folder, version)

    def commit(self, update_id: str, version: int) -> None:
        self._call(self.weights.commit, update_id, version)

    def discard(self, update_id: str) -> None:
        self.weights.discard(update_id)

    def close(self) -> None:
        pass

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except NoriaError as e:
            raise WeightSyncError(f"engine {self.name}: {e}") from e


class HttpEngine:
    """An engine server (``noria serve``, or SGLang for the disk transport) at ``base_url``."""

    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.name = self.base_url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=httpx.Timeout(HTTP_TIMEOUT_S, connect=10.0))

    def specs(self) -> Specs | None:
        """None for a server without ``/weights_info`` (not a noria engine)."""
        body = self._request("GET", "/weights_info", None, missing_ok=True)
        if body is None:
            return None
        tensors = {n: (_dtype(v["dtype"]), tuple(v["shape"])) for n, v in body["tensors"].items()}
        return Specs(tensors, tuple(body.get("checksum_algos", ("sha256",))), str(body.get("device", "cpu")), body.get("device_id"))

    def version(self) -> int:
        from noria.rollout.capabilities import MissingCapability, parse_version

        try:  # SGLang reports a string ("3"; "default" when started without --weight-version)
            return parse_version(self._request("GET", "/get_weight_version", None).get("weight_version"), f"engine {self.name}")
        except MissingCapability as e:
            raise WeightSyncError(str(e)) from e

    def checksums(self, names: list[str], algo: str) -> dict[str, str]:
        body = self._request("POST", "/weights_checksum", {"names": names, "algo": algo}, missing_ok=True)
        if body is None:
            raise WeightSyncError(f"engine {self.name}: no /weights_checksum (not a noria engine); set sync.verify false")
        return body["checksums"]

    def stage(self, bucket: list[tuple[str, torch.Tensor]], update_id: str) -> None:
        raise WeightSyncError(f"engine {self.name}: tensors cannot be handed over in process to an HTTP engine")

    def stage_ipc(self, handle: dict[str, Any], tensors: list[dict[str, Any]], update_id: str) -> None:
        self._request("POST", "/update_weights_from_ipc", {"handle": handle, "tensors": tensors, "update_id": update_id})

    def staging_area(self, update_id: str) -> dict[str, Any] | None:
        """The engine's shared staging area for ``update_id``; None where it has none (a CUDA
        engine, an older server)."""
        try:
            return self._request("POST", "/weights_staging_area", {"update_id": update_id}, missing_ok=True)
        except WeightSyncError:
            return None

    def join_group(self, address: str, port: int, rank: int, world_size: int, group: str, backend: str) -> None:
        body = {"master_address": address, "master_port": port, "rank_offset": rank, "world_size": world_size,
                "group_name": group, "backend": backend}  # fmt: skip
        self._request("POST", "/init_weights_update_group", body)

    def leave_group(self, group: str) -> None:
        pass  # SGLang has no call for it; the engine keeps the (idle) group object

    def stage_broadcast(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group: str, update_id: str,
                        chunks: list[int] | None = None) -> None:  # fmt: skip
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group, "update_id": update_id}
        if chunks is not None:
            body["chunks"] = chunks
        self._request("POST", "/update_weights_from_distributed", body)

    def load_disk(self, folder: Path, version: int) -> None:
        # SGLang's weight_version is a string; noria serve reads digit strings too.
        body = self._request("POST", "/update_weights_from_disk", {"model_path": str(folder), "weight_version": str(version)})
        if isinstance(body, dict) and body.get("success") is False:  # SGLang: 200 with success false on some failures
            raise WeightSyncError(f"engine {self.name}: /update_weights_from_disk failed: {body.get('message', '')[:500]}")

    def commit(self, update_id: str, version: int) -> None:
        self._request("POST", "/commit_weights", {"update_id": update_id, "weight_version": version})

    def discard(self, update_id: str) -> None:
        self._request("POST", "/discard_weights", {"update_id": update_id}, missing_ok=True)

    def close(self) -> None:
        self._client.close()

    def _request(self, method: str, path: str, body: dict | None, missing_ok: bool = False) -> Any:
        try:
            response = self._client.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise WeightSyncError(f"engine {self.name}: {path} failed: {type(e).__name__}: {e}") from e
        if response.status_code == 404 and missing_ok:
            return None
        if response.status_code != 200:
            raise WeightSyncError(f"engine {self.name}: {path} answered {response.status_code}: {_message(response)}")
        return response.json()


def as_target(target: Any, index: int) -> LocalTarget | HttpEngine:
    """An in-process engine (one with a ``weights`` component: ``noria.engine.Engine``, the diffusion
    engine), an :class:`HttpEngine` or a URL string, as a target."""
    if isinstance(target, (LocalTarget, HttpEngine)):
        return target
    if isinstance(target, str):
        return HttpEngine(target)
    from noria.engine.weight_updates import WeightUpdates

    if isinstance(getattr(target, "weights", None), WeightUpdates):
        return LocalTarget(target, f"local[{index}]")
    raise WeightSyncError(f"sync target {index}: expected an Engine, an HttpEngine or a URL, got {type(target).__name__}")


def _dtype(name: str) -> torch.dtype:
    from noria.engine.weights import parse_dtype

    return parse_dtype(name)


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except Exception:  # noqa: BLE001 -- not our JSON shape: show the raw text
        return response.text[:500]
