"""The LoRA adapter endpoints of the engine server, named as SGLang and vLLM name them.

``POST /load_lora_adapter`` ``{"lora_name", "lora_path"}`` loads a peft adapter folder under a name
(Noria's extras: ``version``, the adapter's version, default 0; vLLM's ``load_inplace``: true
updates a loaded adapter in place, keeping its slot, with ``version`` default its version + 1);
``POST /unload_lora_adapter`` ``{"lora_name"}``; ``GET /lora_adapters`` lists the loaded adapters
(name -> version, rank, slot, last use, requests using it). Requests name an adapter with
SGLang's ``lora_path`` on ``/generate`` (``native_api``) and vLLM's ``model`` on the OpenAI routes
(``openai_api``; ``/v1/models`` lists the adapters too). An unknown adapter, a bad folder, or a
load with every slot in use is a 400 whose message names the adapter. Loads run in a thread: the
server keeps answering meanwhile.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from noria.engine.protocol import RequestError
from noria.engine.server.parsing import read_json, reject_unknown, want

if TYPE_CHECKING:
    from noria.engine.server.app import EngineServer


class LoraApi:
    """``/load_lora_adapter``, ``/unload_lora_adapter``, ``/lora_adapters`` over ``server.engine``."""

    def __init__(self, server: EngineServer) -> None:
        self.s = server

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post("/load_lora_adapter", self.load)
        router.add_post("/unload_lora_adapter", self.unload)
        router.add_get("/lora_adapters", self.list)

    def _engine(self) -> Any:
        engine = self.s.engine
        if not hasattr(engine, "load_adapter"):
            raise RequestError(f"this engine ({type(engine).__name__}) serves no LoRA adapters")
        return engine

    async def load(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        reject_unknown(body, {"lora_name", "lora_path", "version", "load_inplace", "pinned"})
        engine = self._engine()
        name, path = want(body, "lora_name", str), want(body, "lora_path", str)
        if not name or not path:
            raise RequestError("load_lora_adapter needs lora_name and lora_path (a peft adapter folder)")
        version = want(body, "version", int)
        if want(body, "load_inplace", bool, False) and name in engine.lora.names:
            version = engine.lora.names[name] + 1 if version is None else version
            await self.s.blocking(engine.update_adapter, name, path, version)
        else:
            await self.s.blocking(engine.load_adapter, name, path, version=version or 0)
        version = engine.lora.names.get(name)
        return web.json_response({"success": True, "message": f"loaded adapter {name!r}", "lora_name": name, "version": version})

    async def unload(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        reject_unknown(body, {"lora_name"})
        name = want(body, "lora_name", str)
        if not name:
            raise RequestError("unload_lora_adapter needs lora_name")
        await self.s.blocking(self._engine().unload_adapter, name)
        return web.json_response({"success": True, "message": f"unloaded adapter {name!r}", "lora_name": name})

    async def list(self, request: web.Request) -> web.Response:
        return web.json_response(await self.s.blocking(self._engine().adapters))


def adapter_of_model(engine: Any, model: Any) -> str | None:
    """vLLM's convention on the OpenAI routes: a ``model`` that names a loaded adapter serves it;
    any other value (the served model's name, or none) serves the base model."""
    names = getattr(getattr(engine, "lora", None), "names", None)
    return model if isinstance(model, str) and names and model in names else None
