"""``VllmEngine``: a vLLM OpenAI server as a weight-sync target (the ``disk`` transport only).

vLLM (0.32) loads a folder of HF safetensors into the running model through its dev-mode routes
(served when the server runs with ``VLLM_SERVER_DEV_MODE=1``)::

    load_disk(folder, v):  POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": folder}}
                           POST /update_weight_version {"new_version": "v"}
                           GET  /weight_info  -> {"weight_version": "v"}   (checked)
    version():             GET  /weight_info

``reload_weights`` is vLLM's in-place reload (``vllm.model_executor.model_loader.reload``): every
tensor of the folder is loaded into the model's parameters (vLLM fuses q/k/v and gate/up itself).
The folder is the one ``noria.sync.disk.DiskTransport`` publishes (complete, renamed into place).

Not offered (each raises ``WeightSyncError`` naming the engine; ``noria.rollout.capabilities``
refuses such configs at start): ipc, broadcast, per-tensor checksums (``sync.verify``). Not
guaranteed: that a reload is atomic for requests running meanwhile: the RL job drains the engine
first (``noria.rollout.vllm_client``), and a reload that fails part way leaves the model partly
updated (vLLM does not stage), so the run stops on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from noria.sync.errors import WeightSyncError
from noria.sync.targets import HttpEngine, Specs


class VllmEngine(HttpEngine):
    """A vLLM server at ``base_url`` (dev mode), loading weights from folders."""

    def specs(self) -> Specs | None:
        return None  # vLLM does not describe its parameters in HF names

    def version(self) -> int:
        from noria.rollout.capabilities import MissingCapability, parse_version

        value = self._request("GET", "/weight_info", None)["weight_version"]
        try:
            return parse_version(value, f"engine {self.name}")
        except MissingCapability as e:
            raise WeightSyncError(str(e)) from e

    def set_version(self, version: int) -> None:
        """Label the weights vLLM serves now as ``version`` (what ``/weight_info`` reports)."""
        self._request("POST", "/update_weight_version", {"new_version": str(version)})
        got = self.version()
        if got != version:
            raise WeightSyncError(f"engine {self.name}: set weight version {version}, but it reports {got}")

    def load_disk(self, folder: Path, version: int) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
        self._request_empty("/collective_rpc", body)
        self.set_version(version)

    def checksums(self, names: list[str], algo: str) -> dict[str, str]:
        raise self._unsupported("per-tensor checksums (set sync.verify false)")

    def stage_ipc(self, handle: dict[str, Any], tensors: list[dict[str, Any]], update_id: str) -> None:
        raise self._unsupported("the ipc transport")

    def staging_area(self, update_id: str) -> dict[str, Any] | None:
        return None

    def join_group(self, address: str, port: int, rank: int, world_size: int, group: str, backend: str) -> None:
        raise self._unsupported("the broadcast transport")

    def stage_broadcast(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group: str, update_id: str,
                        chunks: list[int] | None = None) -> None:  # fmt: skip
        raise self._unsupported("the broadcast transport")

    def stage(self, bucket: list[tuple[str, torch.Tensor]], update_id: str) -> None:
        raise self._unsupported("in-process tensors")

    def commit(self, update_id: str, version: int) -> None:
        raise self._unsupported("staged updates")

    def discard(self, update_id: str) -> None:
        pass  # nothing is staged: a folder loads in one call

    def _unsupported(self, what: str) -> WeightSyncError:
        return WeightSyncError(f"engine {self.name} (vLLM) does not support {what}; use sync.transport: disk")

    def _request_empty(self, path: str, body: dict[str, Any]) -> None:
        """POST a route that answers 200 with an empty body or JSON (``/collective_rpc``)."""
        import httpx

        try:
            response = self._client.post(path, json=body)
        except httpx.HTTPError as e:
            raise WeightSyncError(f"engine {self.name}: {path} failed: {type(e).__name__}: {e}") from e
        if response.status_code != 200:
            raise WeightSyncError(f"engine {self.name}: {path} answered {response.status_code}: {response.text[:500]}")
