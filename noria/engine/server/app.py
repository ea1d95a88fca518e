"""The engine server's application: its life cycle, middleware and entry point (``noria serve``).

The server speaks SGLang's native HTTP API (:mod:`noria.engine.server.native_api`), its weight-update
API (:mod:`noria.engine.server.weights_api`) and the OpenAI API
(:mod:`noria.engine.server.openai_api`) over one ``Engine``, HTTP/1.1 through aiohttp. This module
owns what they share: the phase, the middleware, in-flight tracking for the drain, and the entry
point.

Life cycle (``phase``)::

    loading ──engine built──▶ ready ──SIGTERM/SIGINT──▶ draining ──in-flight done or timeout──▶ exit 0
                                                          (the rest are aborted)

The port is bound BEFORE the model loads, so a client sees 503 (not "connection refused") while
loading: every endpoint answers 503 then, ``/health`` included. While draining, every endpoint but
``/health`` answers 503; requests already admitted run to completion for at most the drain timeout.

What blocks on what: generation is awaited on the event loop (the engine schedules it); weight
updates, group initialisation and cache flushes run in a thread (``blocking``) so that ``/health``
and generation keep answering meanwhile. A client that disconnects has its request aborted in the
engine (its KV blocks are freed); aiohttp cancels the handler on disconnect
(``handler_cancellation``) and the handler aborts the request id before re-raising.

Errors (the middleware): bad input is HTTP 400 ``{"error": {"message": ..., "type":
"invalid_request"}}`` naming the field; a missing or wrong API key is 401; anything else the engine
raises is a 500 with its message, and the server keeps serving. Bounds: a request body holds at most
``BODY_BYTES`` (``/update_weights_from_tensor``: three times the model's bytes plus
``WEIGHT_BODY_SLACK``), past which the answer is 413 and reading stops.

Every response carries the engine's current weight version in the ``X-Weight-Version`` header.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import math
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from noria import openmp
from noria.config import ConfigError, EngineConfig, ModelConfig, option
from noria.engine.protocol import GenerateOutput, GenerateRequest, RequestError
from noria.engine.server.classify_api import ClassifyApi
from noria.engine.server.native_api import NativeApi
from noria.engine.server.openai_api import OpenAIApi
from noria.engine.server.parsing import INVALID, HttpError, maybe_await, refuse_deflate
from noria.engine.server.weights_api import WeightApi
from noria.errors import NoriaError


@dataclass
class ServeConfig:
    """What ``noria serve`` reads from ``--model.*`` / ``--engine.*`` overrides."""

    model: ModelConfig = option(factory=ModelConfig, help="The served model.")
    engine: EngineConfig = option(factory=EngineConfig, help="The built-in rollout engine.")

    def validate(self) -> None:
        """Checks only: both sections' own rules."""
        self.model.validate()
        self.engine.validate()

    def resolve(self) -> None:
        """``model.dtype: auto`` becomes this machine's dtype (``ModelConfig.resolve_dtype``)."""
        self.model.resolve_dtype()


@dataclass
class ServerOptions:
    """How the server listens and shuts down (the non-config flags of ``noria serve``)."""

    host: str = "127.0.0.1"
    """Interface to bind; loopback by default (every Noria server binds 127.0.0.1 unless told otherwise)."""
    port: int = 30000
    api_key: str | None = None
    """When set, every endpoint but ``/health`` (liveness only; sglang-router probes it without a key, and
    SGLang leaves it open too) requires ``Authorization: Bearer <api_key>`` (401 otherwise)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, seconds in-flight requests may take to finish before they are aborted."""
    engine_id: str = ""
    """Name of this engine in ``/server_info`` and in every ``meta_info`` (default host:port)."""
    weight_version: int | None = None
    """Initial weight version of the loaded weights (None keeps the engine's default)."""
    served_model_name: str = ""
    """Model id in the OpenAI API (default: the model path)."""
    insecure_no_key: bool = False
    """Allow binding beyond loopback without ``api_key`` (anyone who reaches the port may generate,
    and load weights). Off: such a server is refused before anything loads."""

    def __post_init__(self) -> None:
        if not self.api_key and not self.insecure_no_key and not is_loopback(self.host):
            raise NoriaError(
                f"noria serve --host {self.host} binds beyond loopback without an API key: anyone who reaches the port "
                "could generate and replace the weights. Set NORIA_API_KEY (or --api-key), or pass --insecure-no-key "
                "to serve without one"
            )


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback interface only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


BODY_BYTES = 64 << 20
"""Largest request body of every route but ``/update_weights_from_tensor`` (a long batch of token ids
fits many times over); more is answered 413 before it is all read."""
WEIGHT_BODY_SLACK = 16 << 20
"""``/update_weights_from_tensor`` may carry the whole model: 3 x its bytes (fp32 of a bf16 model in
base64) plus this."""

def _error_response(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


class EngineServer:
    """One engine behind HTTP. ``load_engine`` builds it and returns (engine, model folder); it
    blocks, so it runs in a thread while the port already answers 503."""

    def __init__(self, load_engine: Callable[[], Any], options: ServerOptions, model_path: str) -> None:
        self.load_engine = load_engine
        self.options = options
        self.model_path = model_path
        self.engine: Any = None
        self.phase = "loading"
        self.load_error: BaseException | None = None
        self.inflight: dict[str, asyncio.Task] = {}
        self.started_at = time.time()
        self.counts: Counter[tuple[str, int]] = Counter()
        self.engine_id = options.engine_id or f"{options.host}:{options.port}"
        self._stop = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    # ----------------------------------------------------------------------------- life cycle

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=BODY_BYTES)
        app.on_response_prepare.append(self._stamp_version)
        for api in (NativeApi(self), WeightApi(self), OpenAIApi(self), ClassifyApi(self)):
            api.register(app.router)
        return app

    async def run(self) -> int:
        """Bind, load the engine, serve until SIGTERM/SIGINT, drain, exit code."""
        runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self.options.host, self.options.port).start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        _log(f"listening on http://{self.options.host}:{self.options.port} (loading {self.model_path})")
        code = 0
        try:
            code = await self._load_and_serve()
        finally:
            await runner.cleanup()
        return code

    async def _load_and_serve(self) -> int:
        load = asyncio.ensure_future(asyncio.to_thread(self.load_engine))
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait([load, stop], return_when=asyncio.FIRST_COMPLETED)
        if not load.done():  # SIGTERM while loading: nothing admitted, nothing to drain
            _log("stopped while loading")
            return 0
        stop.cancel()
        try:
            self.engine, self.model_path = load.result()
        except Exception as e:  # noqa: BLE001 -- reported and turned into the exit code
            _log(f"error: the engine failed to load: {type(e).__name__}: {e}")
            return 2
        self.phase = "ready"
        _log(f"ready: {self.engine_id} serving {self.model_path} (weight version {self.engine.weight_version})")
        await self._stop.wait()
        await self.drain()
        return 0

    async def drain(self) -> None:
        """Refuse new work, let admitted requests finish within the timeout, abort the rest."""
        self.phase = "draining"
        _log(f"draining {len(self.inflight)} in-flight request(s) (at most {self.options.drain_timeout_s} s)")
        try:
            await asyncio.wait_for(self._idle.wait(), self.options.drain_timeout_s)
        except asyncio.TimeoutError:
            left = list(self.inflight)
            _log(f"drain timeout: aborting {len(left)} request(s)")
            for rid in left:
                self.engine.abort(rid)
            try:  # aborted requests answer quickly with finish_reason abort
                await asyncio.wait_for(self._idle.wait(), 5.0)
            except asyncio.TimeoutError:
                pass
        await asyncio.to_thread(self.engine.shutdown, 0.0)
        _log("stopped")

    # ----------------------------------------------------------------------------- middleware

    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """Authentication, admission by phase, and errors to JSON (in that order)."""
        try:
            self._authenticate(request)
            self._admit(request)
            refuse_deflate(request)
            response = await handler(request.clone(client_max_size=self._body_limit(request.path)))
        except HttpError as e:
            response = _error_response(e.status, e.message, e.kind)
            if e.close:
                response.force_close()
        except (RequestError, NoriaError) as e:  # NoriaError: e.g. a refused weight update
            response = _error_response(400, str(e), INVALID)
        except web.HTTPException as e:  # 404, 405 from routing
            response = _error_response(e.status, e.reason or "", "not_found" if e.status == 404 else INVALID)
        except (ConnectionResetError, asyncio.CancelledError):
            raise  # the client went away; nothing to answer
        except Exception as e:  # noqa: BLE001 -- an engine failure answers 500; the server keeps serving
            _log(f"error in {request.path}: {type(e).__name__}: {e}")
            response = _error_response(500, f"{type(e).__name__}: {e}", "internal_error")
        self.counts[(request.path, response.status)] += 1
        return response

    def _authenticate(self, request: web.Request) -> None:
        key = self.options.api_key
        if key is None or request.path == "/health":  # liveness only, open as in SGLang: a router's probe carries no key
            return
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise HttpError(401, "missing or wrong API key (send Authorization: Bearer <key>)", "unauthorized")

    def _body_limit(self, path: str) -> int:
        """Bytes a request body on ``path`` may hold (see ``BODY_BYTES``); past it aiohttp answers 413."""
        if path != "/update_weights_from_tensor" or self.engine is None:
            return BODY_BYTES
        model_bytes = sum(math.prod(shape) * dtype.itemsize for dtype, shape in self.engine.weights.specs().values())
        return 3 * model_bytes + WEIGHT_BODY_SLACK

    def _admit(self, request: web.Request) -> None:
        if self.phase == "ready" or (self.phase == "draining" and request.path == "/health"):
            return
        why = "the engine is loading" if self.phase == "loading" else "the server is shutting down"
        raise HttpError(503, why, "unavailable")

    async def _stamp_version(self, request: web.Request, response: web.StreamResponse) -> None:
        if self.engine is not None:
            response.headers["X-Weight-Version"] = str(self.engine.weight_version)

    # ----------------------------------------------------------------------------- generation

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        """Run one request to the end; abort it in the engine if the client goes away."""
        with self._track(req):
            try:
                return await self.engine.generate(req)
            except asyncio.CancelledError:
                self.engine.abort(req.rid)
                raise

    def claim(self, req: GenerateRequest) -> _Tracked:
        """Register ``req`` as in flight now, for a ``with`` around a stream's whole answer: a request id
        already in flight raises ``RequestError`` (400) here, before any byte of the stream is sent."""
        return self._track(req)

    async def stream(self, req: GenerateRequest, claimed: bool = False) -> AsyncIterator[GenerateOutput]:
        """Partial outputs of one request; aborted in the engine unless it finished. ``claimed``: the
        caller holds ``claim(req)`` already."""
        with contextlib.nullcontext() if claimed else self._track(req):
            finished = False
            parts = self.engine.stream(req)
            try:
                async for part in parts:
                    finished = part.finished
                    yield part
            finally:
                if not finished:
                    self.engine.abort(req.rid)
                if hasattr(parts, "aclose"):
                    await parts.aclose()

    def new_rid(self) -> str:
        return uuid.uuid4().hex

    def _track(self, req: GenerateRequest) -> _Tracked:
        if not req.rid:
            req.rid = self.new_rid()
        if req.rid in self.inflight:
            raise RequestError(f"rid: request id {req.rid!r} is already in flight")
        return _Tracked(self, req.rid)

    async def blocking(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Call an engine method that may block (weight updates) in a thread; await its result. The
        thread gives its OpenMP team back after the call (``noria.openmp``: the pool's threads live on)."""
        return await maybe_await(await asyncio.to_thread(openmp.released(fn), *args, **kwargs))


class _Tracked:
    """Registers a request id as in flight for the drain logic, for the length of a ``with``."""

    def __init__(self, server: EngineServer, rid: str) -> None:
        self.server, self.rid = server, rid

    def __enter__(self) -> None:
        self.server.inflight[self.rid] = asyncio.current_task()
        self.server._idle.clear()

    def __exit__(self, *exc: Any) -> None:
        self.server.inflight.pop(self.rid, None)
        if not self.server.inflight:
            self.server._idle.set()


def _log(message: str) -> None:
    print(f"noria serve: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------- entry point


def load_serve_config(model: str, overrides: list[str], dtype: str | None, device: str | None) -> ServeConfig:
    """``--model``/``--dtype``/``--device`` plus ``--engine.*``/``--model.*`` overrides, validated."""
    from noria.config import load_config

    flags = ["--model.path", model]
    if dtype:
        flags += ["--model.dtype", dtype]
    if device:
        flags += ["--model.device", device]
    for arg in overrides:
        key = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if key and not key.startswith(("engine.", "model.")):
            raise ConfigError(f"noria serve takes only --engine.* and --model.* overrides, got --{key}")
    return load_config(None, flags + overrides, cls=ServeConfig)


def engine_loader(config: ServeConfig, weight_version: int | None = None) -> tuple[Callable[[], Any], str]:
    """A function that builds the engine (heavy imports happen inside it), and the name to show
    until it has: a missing folder raises here, before the port is bound."""
    from noria.models.catalog import CATALOG, model_path

    name = config.model.path
    if name not in CATALOG and not _abspath(name).exists():
        model_path(name)  # raises FileNotFoundError naming the catalog entries

    def load() -> tuple[Any, str]:
        from noria.engine.engine import Engine
        from noria.engine.server.classifier import SequenceClassifier, is_sequence_classifier

        folder = model_path(name)  # a catalog entry is imported here on first use
        if is_sequence_classifier(folder):  # a scalar reward model: /classify only (noria.engine.server.classify_api)
            return SequenceClassifier.from_path(folder, config.model.dtype, config.model.device), str(_abspath(str(folder)))
        kwargs = {} if weight_version is None else {"weight_version": weight_version}
        engine = Engine.from_path(str(folder), config.engine, dtype=config.model.dtype, device=config.model.device, **kwargs)
        return engine, str(_abspath(str(folder)))

    return load, name if name in CATALOG else str(_abspath(name))


def _abspath(name: str) -> Any:
    from pathlib import Path

    return Path(name).expanduser().resolve()


def serve(config: ServeConfig, options: ServerOptions) -> int:
    """Run ``noria serve`` until SIGTERM; the exit code."""
    load, shown = engine_loader(config, options.weight_version)
    server = EngineServer(load, options, shown)
    return asyncio.run(server.run())
