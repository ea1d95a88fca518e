"""``noria serve`` of a DiT folder: the diffusion engine behind HTTP, and its client.

The server is the text engine server's application (``noria.engine.server.app.EngineServer``: life
cycle, loopback default, API key, drain on SIGTERM, 400/401/413/500 mapping, the ``X-Weight-Version``
header) with these routes:

- ``POST /generate_image``: an ``ImageRequest`` as JSON -> an ``ImageOutput`` as JSON (latents as
  base64 of float32 bytes, exact); a client that disconnects has its request aborted;
- SGLang's status and control routes of ``noria.engine.server.native_api`` (``/health``,
  ``/server_info``, ``/model_info``, ``/get_load``, ``/metrics``, ``/get_weight_version``,
  ``/pause_generation``, ``/continue_generation``, ``/abort_request``,
  ``/release_memory_occupation``, ``/resume_memory_occupation``);
- the whole weight-update API (``noria.engine.server.weights_api``), so ``noria.sync``'s
  ``broadcast``, ``disk`` and ``ipc`` (segments) transports push to it as to a text engine.

``DiffusionHttpClient`` is ``noria.rollout.HttpEngineClient`` (same control calls, same failure
classification: a dead or hung server is an ``EngineFailure``) whose ``generate`` posts an
``ImageRequest``.

Not guaranteed: text generation routes (``/generate``, the OpenAI API) answer 404 here; LoRA
adapters are not injected into a served DiT (adapter-only sync needs the colocated engine).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

from aiohttp import web

from noria.diffusion.protocol import ImageOutput, ImageRequest
from noria.engine.server.app import BODY_BYTES, EngineServer
from noria.engine.server.native_api import NativeApi
from noria.engine.server.parsing import read_json
from noria.engine.server.weights_api import WeightApi
from noria.rollout.client import HttpEngineClient

STATUS_ROUTES = {
    "/health": "health", "/server_info": "server_info", "/model_info": "model_info", "/get_load": "get_load",
    "/metrics": "metrics", "/get_weight_version": "get_weight_version", "/pause_generation": "pause_generation",
    "/continue_generation": "continue_generation", "/abort_request": "abort_request",
    "/release_memory_occupation": "release_memory_occupation", "/resume_memory_occupation": "resume_memory_occupation",
}  # fmt: skip
"""The native API's routes a diffusion server answers (handler names of ``NativeApi``)."""


class DiffusionServer(EngineServer):
    """A ``DiffusionEngine`` behind HTTP (see the module docstring)."""

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=BODY_BYTES)
        app.on_response_prepare.append(self._stamp_version)
        native = NativeApi(self)
        for path, name in STATUS_ROUTES.items():
            for method in ("GET", "POST"):
                app.router.add_route(method, path, getattr(native, name))
        WeightApi(self).register(app.router)
        app.router.add_post("/generate_image", self.generate_image)
        return app

    async def generate_image(self, request: web.Request) -> web.Response:
        req = ImageRequest.from_dict(await read_json(request))
        req = dataclasses.replace(req, rid=req.rid or self.new_rid())
        with self._track(types.SimpleNamespace(rid=req.rid)):  # in flight: the drain waits for it
            try:
                out = await self.engine.generate(req)
            except BaseException:
                self.engine.abort(req.rid)  # the client went away (cancelled) or the engine failed
                raise
        return web.json_response(out.to_dict())


class DiffusionHttpClient(HttpEngineClient):
    """A diffusion server over HTTP: ``generate`` takes an ``ImageRequest``."""

    async def generate(self, req: ImageRequest) -> ImageOutput:  # type: ignore[override]
        response = await self._call(self.http.http.post("/generate_image", json=req.to_dict()))
        if response.is_error:
            from noria.rollout.client import EngineFailure

            raise EngineFailure(f"{self.name}/generate_image answered {response.status_code}: {response.text[:500]}")
        return ImageOutput.from_dict(response.json())


def serve_diffusion(config: Any, options: Any) -> int:
    """``noria serve --model DIT_FOLDER``: run until SIGTERM; the exit code."""
    import asyncio

    server = DiffusionServer(diffusion_loader(config, options.weight_version), options, str(config.model.path))
    return asyncio.run(server.run())


def diffusion_loader(config: Any, weight_version: int | None = None) -> Any:
    """A function building the engine of ``noria serve`` for a DiT folder (see ``engine_loader``)."""

    def load() -> tuple[Any, str]:
        from pathlib import Path

        from noria.diffusion.engine import DiffusionEngine

        folder = Path(config.model.path).expanduser().resolve()
        engine = DiffusionEngine.from_path(folder, config.engine, dtype=config.model.dtype, device=config.model.device,
                                           weight_version=weight_version or 0)  # fmt: skip
        return engine, str(folder)

    return load
