"""The engine's LoRA API: load, update, unload and list adapters (``Engine`` inherits it).

``load_adapter`` / ``update_adapter`` read and check the tensors on the caller's thread (a peft
folder is read there too), then install them on the engine thread between two steps, so no step
runs half of an update. A request naming an adapter (``GenerateRequest.adapter``) pins it from
the moment the engine takes it until it ends (``noria.engine.lora``): unloading a pinned adapter
is refused, and eviction passes it over.

Blocking: each call until its command has run on the engine thread (at most one step).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from noria.engine.lora import AdapterError, LoraRegistry, parse_adapter, read_folder
from noria.engine.protocol import GenerateRequest, RequestError


class AdapterMethods:
    """Mixed into ``noria.engine.Engine``: its adapter registry (``self.lora``) and API."""

    lora: LoraRegistry

    def load_adapter(
        self, name: str, source: str | Path | dict[str, torch.Tensor], *, version: int = 0, config: dict | None = None
    ) -> None:
        """Serve adapter ``name`` from ``source``: a peft adapter folder, or peft-named tensors with
        ``config`` (peft's adapter_config: ``r``, ``lora_alpha``, ``target_modules``). Loading a
        name again replaces it (refused while requests use it: use :meth:`update_adapter`). With
        every slot (``engine.lora_max_adapters``) in use, raises :class:`AdapterError`."""
        _check_name(name)
        if isinstance(source, (str, Path)):
            tensors, folder_config = read_folder(source)
            config = config or folder_config
        elif isinstance(source, dict):
            if config is None:
                raise AdapterError(f"adapter {name!r}: tensors need config= (peft's adapter_config: r, lora_alpha)")
            tensors = source
        else:
            raise AdapterError(f"adapter {name!r}: source must be a peft folder or a dict of tensors, got {type(source).__name__}")
        parsed = parse_adapter(name, tensors, config, self.lora.modules)
        self._thread.call(lambda: self.lora.install(name, parsed, version))

    def update_adapter(self, name: str, tensors: dict[str, torch.Tensor] | str | Path, version: int) -> None:
        """New weights for loaded adapter ``name`` in place (same rank and modules; adapter-only
        sync): requests on it continue with them from the next step; its version becomes
        ``version`` and its prefix-cache entries are no longer matched."""
        _check_name(name)
        if isinstance(tensors, (str, Path)):
            tensors, _ = read_folder(tensors)
        adapter = self._thread.call(lambda: self.lora.get(name))
        config = {"r": adapter.rank, "lora_alpha": adapter.scaling * adapter.rank}
        parsed = parse_adapter(name, tensors, config, self.lora.modules)
        self._thread.call(lambda: self.lora.update(name, parsed, version))

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``; refused while a request uses it."""
        self._thread.call(lambda: self.lora.unload(name))

    def adapters(self) -> dict[str, dict[str, Any]]:
        """name -> {version, rank, scaling, slot, last_used (unix time), in_use (requests), modules}."""
        return self._thread.call(self.lora.info)

    # ------------------------------------------------------------------------------ engine hooks

    def _check_adapter(self, req: GenerateRequest) -> None:
        """Submit-time check (caller's thread): the request's adapter is loaded."""
        name = req.adapter
        if name is None:
            return
        if not isinstance(name, str):
            raise RequestError(f"adapter must be a string (an adapter's name), got {name!r}")
        if name not in self.lora.names:
            raise RequestError(f"unknown adapter {name!r}; loaded: {sorted(self.lora.names)}")

    def _pin_adapter(self, req) -> str | None:
        """Engine thread, as the request arrives: pin its adapter (``req.lora``); the error message
        when it is gone since the submit."""
        if req.request.adapter is None:
            return None
        try:
            req.lora = self.lora.pin(req.request.adapter)
        except AdapterError as e:
            return str(e)
        return None

    def _unpin_adapter(self, req) -> None:
        """Engine thread, once: the request ended."""
        if req.lora is not None and not getattr(req, "lora_released", False):
            req.lora_released = True
            self.lora.unpin(req.lora)


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name or len(name) > 256:
        raise AdapterError(f"an adapter's name must be a non-empty string of at most 256 characters, got {name!r}")
