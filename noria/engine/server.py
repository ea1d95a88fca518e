"""The engine's HTTP server: SGLang's native API and the OpenAI API over one ``Engine``.

What this module owns: translating HTTP requests into ``GenerateRequest`` records and
``GenerateOutput`` records back into SGLang-shaped (``text``, ``output_ids``, ``meta_info``) or
OpenAI-shaped JSON, plus the server's life cycle. It speaks HTTP/1.1 (aiohttp); a real SGLang server
can stand in for it, and sglang-router can sit in front of it.

Life cycle (``phase``)::

    loading ──engine built──▶ ready ──SIGTERM/SIGINT──▶ draining ──in-flight done or timeout──▶ exit 0
                                                          (the rest are aborted)

The port is bound BEFORE the model loads, so a client sees 503 (not "connection refused") while
loading: every endpoint answers 503 then, ``/health`` included. While draining, every endpoint but
``/health`` answers 503; requests already admitted run to completion for at most the drain timeout.

What blocks on what: generation is awaited on the event loop (the engine schedules it); weight
updates, group initialisation (a rendezvous that waits for the trainer) and cache flushes run in a
thread so that ``/health`` and generation keep answering meanwhile. A client that disconnects has
its request aborted in the engine (its KV blocks are freed); aiohttp cancels the handler on
disconnect (``handler_cancellation``) and the handler aborts the request id before re-raising.

Errors: bad input (malformed JSON, unknown or out-of-range fields, empty or too long prompts, wrong
types) is HTTP 400 ``{"error": {"message": ..., "type": "invalid_request"}}``; the message names the
field. A missing or wrong API key is 401. Anything the engine raises that is not a
``RequestError`` is a 500 with its message; the server keeps serving.

Bounds: a request body holds at most ``BODY_BYTES`` (64 MiB; ``/update_weights_from_tensor``: three
times the model's bytes plus 16 MiB), past which the answer is 413 and reading stops; a seed is a
64-bit integer; weights holding NaN or Inf are refused (400); ``/init_weights_update_group`` waits
at most ``timeout_s`` (default and most ``weights.JOIN_TIMEOUT_S``) for the rendezvous.

Every response carries the engine's current weight version in the ``X-Weight-Version`` header, and
generation results carry the version that produced their tokens in the body.

Weight updates (``noria.sync`` is the client): every update is staged, then committed, so a refused
or failed one (HTTP 400, naming the tensor or file) leaves the weights and version as they were.
Noria's extensions to SGLang's API: ``/update_weights_from_ipc`` (a shared-memory segment or CUDA
IPC buffer of a process on this machine, or the engine's own staging area that such a process
wrote, see ``/weights_staging_area``), ``update_id`` on it and on
``/update_weights_from_distributed`` (stage a part only), ``/commit_weights`` and
``/discard_weights`` (apply or drop all parts of one update), ``/weights_info`` (names, dtypes,
shapes) and ``/weights_checksum`` (bitwise hashes of the live weights). SGLang's
``/release_memory_occupation`` and ``/resume_memory_occupation`` free and re-allocate the KV cache.

``/update_weights_from_tensor`` takes JSON, not SGLang's pickled tensors (unpickling a request body
would run arbitrary code)::

    {"named_tensors": [{"name": "model.norm.weight", "dtype": "bfloat16", "shape": [64],
                        "data": "<base64 of the raw little-endian bytes>"},       # or
                       {"name": "lm_head.weight", "dtype": "float32", "shape": [2, 2],
                        "data": [[0.1, 0.2], [0.3, 0.4]]}],                       # nested lists
     "weight_version": 3}

Not guaranteed: streamed batches (``stream`` with a list of prompts) are refused; OpenAI function
calling, ``response_format``, ``echo`` and penalties are refused with a 400, not emulated.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import inspect
import json
import math
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from noria.config import ConfigError, EngineConfig, ModelConfig, option
from noria.engine.protocol import GenerateOutput, GenerateRequest, RequestError, SamplingParams
from noria.errors import NoriaError

# ------------------------------------------------------------------------------------------ config


@dataclass
class ServeConfig:
    """What ``noria serve`` reads from ``--model.*`` / ``--engine.*`` overrides."""

    model: ModelConfig = option(factory=ModelConfig, help="The served model.")
    engine: EngineConfig = option(factory=EngineConfig, help="The built-in rollout engine.")

    def validate(self) -> None:
        self.model.validate()
        self.engine.validate()
        self.model.resolve_dtype()


@dataclass
class ServerOptions:
    """How the server listens and shuts down (the non-config flags of ``noria serve``)."""

    host: str = "127.0.0.1"
    """Interface to bind; loopback by default (see DESIGN.md: servers bind 127.0.0.1)."""
    port: int = 30000
    api_key: str | None = None
    """When set, every endpoint requires ``Authorization: Bearer <api_key>`` (401 otherwise)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, seconds in-flight requests may take to finish before they are aborted."""
    engine_id: str = ""
    """Name of this engine in ``/server_info`` and in every ``meta_info`` (default host:port)."""
    weight_version: int | None = None
    """Initial weight version of the loaded weights (None keeps the engine's default)."""
    served_model_name: str = ""
    """Model id in the OpenAI API (default: the model path)."""


INVALID = "invalid_request"
BODY_BYTES = 64 << 20
"""Largest request body of every route but ``/update_weights_from_tensor`` (a long batch of token ids
fits many times over); more is answered 413 before it is all read."""
WEIGHT_BODY_SLACK = 16 << 20
"""``/update_weights_from_tensor`` may carry the whole model: 3 x its bytes (fp32 of a bf16 model in
base64) plus this."""
ONE_TOKEN = {"max_new_tokens": 1, "temperature": 0.0}


class HttpError(Exception):
    """An error answered with a JSON body ``{"error": {"message", "type"}}`` and a status."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def _error_response(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


# ------------------------------------------------------------------------------------------ server


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
        native = NativeApi(self)
        openai = OpenAIApi(self)
        native.register(app.router)
        openai.register(app.router)
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
            response = await handler(request.clone(client_max_size=self._body_limit(request.path)))
        except HttpError as e:
            response = _error_response(e.status, e.message, e.kind)
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
        if key is None:
            return
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise HttpError(401, "missing or wrong API key (send Authorization: Bearer <key>)", "unauthorized")

    def _body_limit(self, path: str) -> int:
        """Bytes a request body on ``path`` may hold (see ``BODY_BYTES``); past it aiohttp answers 413."""
        if path != "/update_weights_from_tensor" or self.engine is None:
            return BODY_BYTES
        model_bytes = sum(math.prod(shape) * dtype.itemsize for dtype, shape in self.engine.weight_specs().values())
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

    async def stream(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Partial outputs of one request; aborted in the engine unless it finished."""
        with self._track(req):
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
        """Call an engine method that may block (weight updates) in a thread; await its result."""
        return await _maybe_await(await asyncio.to_thread(fn, *args, **kwargs))


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


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _log(message: str) -> None:
    print(f"noria serve: {message}", file=sys.stderr, flush=True)


# -------------------------------------------------------------------------------- request parsing


async def read_json(request: web.Request, required: bool = True) -> dict[str, Any]:
    """The request body as a JSON object (an empty body is ``{}`` unless ``required``)."""
    raw = await request.read()
    if not raw.strip():
        if required:
            raise RequestError("the request body is empty; expected a JSON object")
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


ANY = object()
"""Marks an inert field whose every value is accepted (and ignored)."""

# Fields that SGLang clients, and sglang-router when it forwards a request, send with their default
# values. They are accepted at those values (ANY: at every value, and ignored); any other value
# asks for a feature this server does not have, which is a 400, never a silent no-op.
INERT_NATIVE = {
    "model": ANY, "log_metrics": ANY, "no_logs": ANY, "return_hidden_states": False, "background": False,
    "return_bytes": False, "return_entropy": False, "logprob_start_len": -1, "custom_logit_processor": None,
    "return_routed_experts": False, "lora_path": None, "session_params": None, "bootstrap_host": None,
}  # fmt: skip
INERT_OPENAI = {
    "user": ANY, "no_stop_trim": False, "continue_final_message": False, "skip_special_tokens": True,
    "separate_reasoning": ANY, "stream_reasoning": ANY, "return_hidden_states": False, "echo": False,
    "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": None, "tools": None,
    "tool_choice": ANY, "response_format": None, "parallel_tool_calls": ANY, "chat_template_kwargs": None,
    "stream_options": ANY, "rid": None, "regex": None, "json_schema": None, "ebnf": None, "min_tokens": 0,
    "suffix": None, "best_of": None, "lora_path": None, "session_params": None, "return_routed_experts": False,
}  # fmt: skip


def drop_inert(body: dict[str, Any], inert: dict[str, Any]) -> dict[str, Any]:
    """``body`` without inert fields at their accepted values; another value is a ``RequestError``."""
    kept = {}
    for key, value in body.items():
        if key not in inert:
            kept[key] = value
        elif inert[key] is not ANY and value is not None and value != inert[key]:
            raise RequestError(f"{key}={value!r} is not supported by this server (only {inert[key]!r})")
    return kept


def reject_unknown(body: dict[str, Any], known: set[str], where: str = "") -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"{where}unknown field(s) {unknown}; known: {sorted(known)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def want(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    """``body[name]`` checked against ``kind`` (bool is not an int here), or ``default`` if absent."""
    value = body.get(name, default)
    if value is None:
        return default
    if kind is int or (isinstance(kind, tuple) and int in kind and bool not in kind):
        if isinstance(value, bool):
            raise RequestError(f"{name} has the wrong type: expected {_type_name(kind)}, got {value!r}")
    if kind is float and _is_int(value):
        return float(value)
    if not isinstance(value, kind):
        raise RequestError(f"{name} has the wrong type: expected {_type_name(kind)}, got {type(value).__name__}")
    return value


def _type_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def check_ids(ids: Any, name: str, vocab_size: int | None) -> list[int]:
    """A prompt of token ids: a non-empty list of ints inside the vocabulary."""
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise RequestError(f"{name} must be a list of integers")
    if not ids:
        raise RequestError(f"{name} is empty: a prompt needs at least one token")
    for i, t in enumerate(ids):
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise RequestError(f"{name}[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
    return ids


def sampling_from(data: Any, name: str = "sampling_params") -> SamplingParams:
    if data is not None and not isinstance(data, dict):
        raise RequestError(f"{name} must be a JSON object, got {type(data).__name__}")
    try:
        return SamplingParams.from_dict(data)
    except TypeError as e:  # e.g. a field given a value the dataclass cannot take
        raise RequestError(f"{name}: {e}") from e


# ------------------------------------------------------------------------------------ native API


class NativeApi:
    """SGLang's native endpoints."""

    GENERATE_FIELDS = {
        "text", "input_ids", "sampling_params", "rid", "return_logprob", "top_logprobs_num", "stream",
        "return_text_in_logprobs", "routing_key",
    }  # fmt: skip

    def __init__(self, server: EngineServer) -> None:
        self.s = server

    def register(self, router: web.UrlDispatcher) -> None:
        routes = {
            "/generate": ("POST", self.generate),
            "/health": ("GET", self.health),
            "/health_generate": ("GET", self.health_generate),
            "/server_info": ("GET", self.server_info),
            "/get_server_info": ("GET", self.server_info),
            "/model_info": ("GET", self.model_info),
            "/get_model_info": ("GET", self.model_info),
            "/get_load": ("GET", self.get_load),
            "/metrics": ("GET", self.metrics),
            "/get_weight_version": ("GET", self.get_weight_version),
            "/flush_cache": ("POST", self.flush_cache),
            "/pause_generation": ("POST", self.pause_generation),
            "/continue_generation": ("POST", self.continue_generation),
            "/abort_request": ("POST", self.abort_request),
            "/update_weights_from_disk": ("POST", self.update_weights_from_disk),
            "/init_weights_update_group": ("POST", self.init_weights_update_group),
            "/update_weights_from_distributed": ("POST", self.update_weights_from_distributed),
            "/update_weights_from_tensor": ("POST", self.update_weights_from_tensor),
            "/update_weights_from_ipc": ("POST", self.update_weights_from_ipc),
            "/weights_staging_area": ("POST", self.weights_staging_area),
            "/commit_weights": ("POST", self.commit_weights),
            "/discard_weights": ("POST", self.discard_weights),
            "/weights_info": ("GET", self.weights_info),
            "/weights_checksum": ("GET", self.weights_checksum),
            "/release_memory_occupation": ("POST", self.release_memory_occupation),
            "/resume_memory_occupation": ("POST", self.resume_memory_occupation),
        }
        for path, (method, handler) in routes.items():
            router.add_route(method, path, handler)
            # SGLang answers GET and POST on most control endpoints; clients use either.
            router.add_route("POST" if method == "GET" else "GET", path, handler)

    # ------------------------------------------------------------------------------ /generate

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = drop_inert(await read_json(request), INERT_NATIVE)
        reject_unknown(body, self.GENERATE_FIELDS)
        reqs, batched = self.parse_generate(body)
        with_text = bool(want(body, "return_text_in_logprobs", bool, False))
        if want(body, "stream", bool, False):
            if batched:
                raise RequestError("stream: streaming is supported for one prompt at a time, not a batch")
            return await self._stream(request, reqs[0], with_text)
        outs = await asyncio.gather(*(self.s.generate(r) for r in reqs))
        results = [self.result(r, o, with_text) for r, o in zip(reqs, outs)]
        return web.json_response(results if batched else results[0])

    def parse_generate(self, body: dict[str, Any]) -> tuple[list[GenerateRequest], bool]:
        """The requests of a ``/generate`` body, and whether it was a batch."""
        prompts, batched = self._prompts(body)
        n = len(prompts)
        samplings = _per_item(body.get("sampling_params"), n, "sampling_params", dict)
        rids = _per_item(body.get("rid"), n, "rid", str)
        logprobs = _per_item(body.get("return_logprob"), n, "return_logprob", bool)
        top_k = want(body, "top_logprobs_num", int, 0)
        if top_k < 0:
            raise RequestError(f"top_logprobs_num must be >= 0, got {top_k}")
        key = want(body, "routing_key", str) or None
        reqs = []
        for i, ids in enumerate(prompts):
            where = f"sampling_params[{i}]" if isinstance(body.get("sampling_params"), list) else "sampling_params"
            sampling = sampling_from(samplings[i], where)
            self.check_context(ids, sampling, f"input_ids[{i}]" if batched else "input_ids")
            reqs.append(GenerateRequest(
                input_ids=ids, sampling=sampling, rid=rids[i] or "",
                return_logprob=True if logprobs[i] is None else logprobs[i],
                top_logprobs_num=top_k, routing_key=key,
            ))  # fmt: skip
        return reqs, batched

    def _prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
        has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
        if has_text == has_ids:
            raise RequestError("give exactly one of text or input_ids")
        if has_ids:
            ids = body["input_ids"]
            if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
                return [check_ids(x, f"input_ids[{i}]", self.vocab_size) for i, x in enumerate(ids)], True
            return [check_ids(ids, "input_ids", self.vocab_size)], False
        text = body["text"]
        if isinstance(text, str):
            return [self.tokenize(text, "text")], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [self.tokenize(t, f"text[{i}]") for i, t in enumerate(text)], True
        raise RequestError("text must be a string or a non-empty list of strings")

    def tokenize(self, text: str, name: str) -> list[int]:
        tok = self.s.engine.tokenizer
        if tok is None:
            raise RequestError(f"{name}: this engine has no tokenizer; send input_ids")
        ids = list(tok.encode(text))
        if not ids:
            raise RequestError(f"{name} is empty: a prompt needs at least one token")
        return ids

    @property
    def vocab_size(self) -> int | None:
        return _engine_attr(self.s.engine, "vocab_size")

    def check_context(self, ids: list[int], sampling: SamplingParams, name: str) -> None:
        limit = _engine_attr(self.s.engine, "max_context")
        if limit is not None and len(ids) >= limit:
            raise RequestError(f"{name}: the prompt has {len(ids)} tokens; the context holds {limit} (prompt + output)")

    def result(self, req: GenerateRequest, out: GenerateOutput, with_text: bool) -> dict[str, Any]:
        """SGLang's response record for one output."""
        info = out.meta_info()
        info["engine_id"] = self.s.engine_id
        if out.weight_version is None:  # nothing generated: report the version that would have
            info["weight_version"] = self.s.engine.weight_version
        if not req.return_logprob:
            info.pop("output_token_logprobs", None)
            info.pop("output_top_logprobs", None)
        elif with_text:
            self._add_token_text(info, out)
        return {"text": out.text, "output_ids": out.output_ids, "meta_info": info}

    def _add_token_text(self, info: dict[str, Any], out: GenerateOutput) -> None:
        texts = _token_texts(self.s.engine.tokenizer, out.output_ids)
        for entry, t in zip(info.get("output_token_logprobs", []), texts):
            entry[2] = t
        for step in info.get("output_top_logprobs", []) or []:
            for entry, t in zip(step, _token_texts(self.s.engine.tokenizer, [e[1] for e in step])):
                entry[2] = t

    async def _stream(self, request: web.Request, req: GenerateRequest, with_text: bool) -> web.StreamResponse:
        response = await _sse_response(request)
        async for part in self.s.stream(req):
            await _sse(response, self.result(req, part, with_text))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # ------------------------------------------------------------------------------- status

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def health_generate(self, request: web.Request) -> web.Response:
        """A real one-token greedy generation through the scheduler."""
        token = 0 if self.s.engine.tokenizer is None else _first_token(self.s.engine.tokenizer)
        req = GenerateRequest(input_ids=[token], sampling=SamplingParams(**ONE_TOKEN), rid=f"health-{self.s.new_rid()}")
        out = await self.s.generate(req)
        if len(out.output_ids) != 1:
            raise HttpError(503, f"health generation produced {len(out.output_ids)} tokens", "unhealthy")
        return web.Response(text="")

    async def server_info(self, request: web.Request) -> web.Response:
        e, o = self.s.engine, self.s.options
        config = getattr(e, "config", None)
        return web.json_response({
            "engine_id": self.s.engine_id,
            "model_path": self.s.model_path,
            "tokenizer_path": self.s.model_path,
            "served_model_name": self.model_name,
            "host": o.host, "port": o.port,
            "dp_size": 1, "tp_size": 1,
            "is_embedding": False,
            "weight_version": e.weight_version,
            "max_context": _engine_attr(e, "max_context"),
            "engine_config": _as_dict(config),
            "uptime_s": round(time.time() - self.s.started_at, 3),
            "version": "noria",
        })  # fmt: skip

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.s.model_path,
            "tokenizer_path": self.s.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.s.engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": self.hf_config.get("model_type"),
            "architectures": self.hf_config.get("architectures"),
        })  # fmt: skip

    @property
    def hf_config(self) -> dict[str, Any]:
        from pathlib import Path

        path = Path(self.s.model_path) / "config.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    @property
    def model_name(self) -> str:
        return self.s.options.served_model_name or self.s.model_path

    async def get_load(self, request: web.Request) -> web.Response:
        load = dict(await _maybe_await(self.s.engine.get_load()) or {})
        load.setdefault("num_inflight_http", len(self.s.inflight))
        load["weight_version"] = self.s.engine.weight_version
        return web.json_response(load)

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.s.engine.weight_version})

    async def metrics(self, request: web.Request) -> web.Response:
        metrics = dict(await _maybe_await(self.s.engine.metrics()) or {})
        metrics["weight_version"] = self.s.engine.weight_version
        metrics["inflight_requests"] = len(self.s.inflight)
        lines = prometheus_lines("noria_engine_", metrics)
        for (path, status), count in sorted(self.s.counts.items()):
            lines.append(f'noria_http_requests_total{{path="{_label(path)}",status="{status}"}} {count}')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")

    # ------------------------------------------------------------------------------ control

    async def flush_cache(self, request: web.Request) -> web.Response:
        dropped = await self.s.blocking(self.s.engine.flush_cache)
        return web.json_response({"success": True, "message": "cache flushed", "blocks_dropped": dropped})

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await read_json(request, required=False)
        reject_unknown(body, {"mode"})
        mode = want(body, "mode", str, "retract")
        if mode not in ("retract", "in_place"):
            raise RequestError(f"mode must be 'retract' or 'in_place', got {mode!r}")
        await _maybe_await(self.s.engine.pause(mode=mode))
        return web.json_response({"success": True, "message": f"paused ({mode})"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await read_json(request, required=False)
        await _maybe_await(self.s.engine.resume())
        return web.json_response({"success": True, "message": "resumed"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        reject_unknown(body, {"rid", "abort_all"})
        rid = want(body, "rid", str, "")
        if want(body, "abort_all", bool, False):
            rids = list(self.s.inflight)
        elif rid:
            rids = [rid]
        else:
            raise RequestError("rid: give the request id to abort (or abort_all: true)")
        for r in rids:
            await _maybe_await(self.s.engine.abort(r))
        return web.json_response({"success": True, "aborted": rids})

    # ------------------------------------------------------------------------------ weights

    def _version(self, body: dict[str, Any]) -> int:
        """``weight_version`` of an update: an int (or SGLang's digit string); default current + 1."""
        value = body.get("weight_version")
        if value is None:
            return int(self.s.engine.weight_version) + 1
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if not _is_int(value):
            raise RequestError(f"weight_version must be an integer, got {value!r}")
        return value

    def _updated(self, message: str) -> web.Response:
        return web.json_response({"success": True, "message": message, "weight_version": self.s.engine.weight_version})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        reject_unknown(body, {"model_path", "weight_version", "load_format", "abort_all_requests"})
        path = want(body, "model_path", str)
        if not path:
            raise RequestError("model_path: give the folder holding the new weights")
        version = self._version(body)
        await self.s.blocking(self.s.engine.update_weights_from_disk, path, version)
        return self._updated(f"loaded weights from {path}")

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        names = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend", "timeout_s"}
        reject_unknown(body, names)
        from noria.engine.weights import JOIN_TIMEOUT_S

        timeout_s = want(body, "timeout_s", (int, float), JOIN_TIMEOUT_S)
        if not 0 < timeout_s <= JOIN_TIMEOUT_S:
            raise RequestError(f"timeout_s must be in (0, {JOIN_TIMEOUT_S:g}], got {timeout_s}")
        address = want(body, "master_address", str)
        port, offset, world = (want(body, k, int) for k in ("master_port", "rank_offset", "world_size"))
        if address is None or port is None or offset is None or world is None:
            raise RequestError("master_address, master_port, rank_offset and world_size are required")
        group = want(body, "group_name", str, "weight_update_group")
        backend = want(body, "backend", str, "nccl")
        join = self.s.engine.init_weights_update_group
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
            n = await self.s.blocking(self.s.engine.stage_weights_from_distributed, names, dtypes, shapes, group, update_id, chunks)
            return self._staged(update_id, n)
        if chunks is not None:
            raise RequestError("chunks needs an update_id (stage, then /commit_weights)")
        version = self._version(body)
        await self.s.blocking(self.s.engine.update_weights_from_distributed, names, dtypes, shapes, version, group)
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
            n = await self.s.blocking(self.s.engine.stage_weights_from_ipc, handle, tensors, update_id)
            return self._staged(update_id, n)
        version = self._version(body)
        await self.s.blocking(self.s.engine.update_weights_from_ipc, handle, tensors, version)
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
        return web.json_response(await self.s.blocking(self.s.engine.weights_staging_area, update_id))

    async def commit_weights(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        reject_unknown(body, {"update_id", "weight_version"})
        update_id = want(body, "update_id", str)
        if not update_id:
            raise RequestError("update_id: give the id the update's parts were staged under")
        version = self._version(body)
        changed = await self.s.blocking(self.s.engine.commit_weights, update_id, version)
        return self._updated(f"committed update {update_id}: {len(changed)} parameter(s)")

    async def discard_weights(self, request: web.Request) -> web.Response:
        body = await read_json(request, required=False)
        reject_unknown(body, {"update_id"})
        dropped = await self.s.blocking(self.s.engine.discard_weights, want(body, "update_id", str))
        return web.json_response({"success": True, "discarded": dropped})

    def _staged(self, update_id: str, n: int) -> web.Response:
        return web.json_response({
            "success": True, "message": f"staged {n} tensor(s) for update {update_id}", "update_id": update_id,
            "weight_version": self.s.engine.weight_version,
        })  # fmt: skip

    async def weights_info(self, request: web.Request) -> web.Response:
        """Every tensor an update may name, with dtype and shape; checksum algorithms on offer."""
        from noria.engine.weights import CHECKSUM_ALGOS, dtype_name

        specs = self.s.engine.weight_specs()
        return web.json_response({
            "tensors": {n: {"dtype": dtype_name(d), "shape": list(shape)} for n, (d, shape) in specs.items()},
            "checksum_algos": list(CHECKSUM_ALGOS),
            "device": str(getattr(self.s.engine, "device", "cpu")),
            "weight_version": self.s.engine.weight_version,
        })  # fmt: skip

    async def weights_checksum(self, request: web.Request) -> web.Response:
        """``{"checksums": {name: hex}}`` of the live weights; ``names`` (a JSON list, or a
        comma-separated query parameter) limits them, ``algo`` picks the hash (default sha256)."""
        body = await read_json(request, required=False)
        reject_unknown(body, {"names", "algo"})
        names = want(body, "names", list)
        if names is None and request.query.get("names"):
            names = request.query["names"].split(",")
        algo = want(body, "algo", str) or request.query.get("algo", "sha256")
        sums = await self.s.blocking(self.s.engine.weight_checksums, names, algo)
        return web.json_response({"algo": algo, "checksums": sums, "weight_version": self.s.engine.weight_version})

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        await read_json(request, required=False)
        await self.s.blocking(self.s.engine.release_memory_occupation)
        return web.json_response({"success": True, "message": "KV cache released"})

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        await read_json(request, required=False)
        await self.s.blocking(self.s.engine.resume_memory_occupation)
        return web.json_response({"success": True, "message": "KV cache allocated"})

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        if "serialized_named_tensors" in body:
            raise RequestError("serialized_named_tensors (pickled) is not accepted; send named_tensors as JSON")
        reject_unknown(body, {"named_tensors", "weight_version", "flush_cache", "load_format"})
        tensors = decode_named_tensors(body.get("named_tensors"))
        check_finite(tensors)
        version = self._version(body)
        await self.s.blocking(self.s.engine.update_weights_from_state_dict, tensors, version)
        return self._updated(f"updated {len(tensors)} tensor(s)")


def _per_item(value: Any, n: int, name: str, kind: type) -> list[Any]:
    """A per-prompt field: one value for all prompts, or a list with one per prompt."""
    if isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for {n} prompt(s)")
        items = value
    else:
        items = [value] * n
    for item in items:
        if item is not None and (not isinstance(item, kind) or (kind is not bool and isinstance(item, bool))):
            raise RequestError(f"{name} has the wrong type: expected {kind.__name__}, got {type(item).__name__}")
    return items


def _engine_attr(engine: Any, name: str) -> Any:
    value = getattr(engine, name, None)
    return value() if callable(value) else value


def _as_dict(config: Any) -> Any:
    import dataclasses

    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else None


def _first_token(tokenizer: Any) -> int:
    ids = tokenizer.encode("a", add_special_tokens=False)
    return ids[0] if ids else 0


def _token_texts(tokenizer: Any, ids: list[int]) -> list[str | None]:
    if tokenizer is None:
        return [None] * len(ids)
    return [tokenizer.decode([t]) for t in ids]


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def prometheus_lines(prefix: str, metrics: dict[str, Any]) -> list[str]:
    """Numeric metrics as Prometheus gauges (nested dicts flatten with ``_``; other values skipped)."""
    lines = []
    for key, value in sorted(metrics.items()):
        name = prefix + "".join(c if c.isalnum() or c == "_" else "_" for c in str(key))
        if isinstance(value, dict):
            lines.extend(prometheus_lines(name + "_", value))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            lines += [f"# TYPE {name} gauge", f"{name} {value}"]
        elif isinstance(value, bool):
            lines += [f"# TYPE {name} gauge", f"{name} {int(value)}"]
    return lines


async def _sse_response(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def _sse(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


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
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
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


# ------------------------------------------------------------------------------------ OpenAI API


class OpenAIApi:
    """``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` over the same engine."""

    COMMON = {
        "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
        "stop_token_ids", "ignore_eos", "seed", "n", "stream", "logprobs", "routing_key",
    }  # fmt: skip
    COMPLETION = COMMON | {"prompt"}
    CHAT = COMMON | {"messages", "top_logprobs", "add_generation_prompt"}

    def __init__(self, server: EngineServer) -> None:
        self.s = server
        self.native = NativeApi(server)

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_get("/v1/models", self.models)
        router.add_post("/v1/completions", self.completions)
        router.add_post("/v1/chat/completions", self.chat)

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.native.model_name, "object": "model", "created": int(self.s.started_at),
            "owned_by": "noria", "root": self.s.model_path, "max_model_len": _engine_attr(self.s.engine, "max_context"),
            "weight_version": self.s.engine.weight_version,
        }  # fmt: skip
        return web.json_response({"object": "list", "data": [card]})

    # ------------------------------------------------------------------------------ parsing

    def sampling(self, body: dict[str, Any]) -> SamplingParams:
        """OpenAI sampling fields -> ``SamplingParams`` (OpenAI's defaults: 16 tokens for completions)."""
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        data = {
            "max_new_tokens": 16 if max_tokens is None and "messages" not in body else max_tokens,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "top_k": body.get("top_k"),
            "min_p": body.get("min_p"), "stop": body.get("stop"), "stop_token_ids": body.get("stop_token_ids"),
            "ignore_eos": body.get("ignore_eos"), "seed": body.get("seed"),
        }  # fmt: skip
        data = {k: v for k, v in data.items() if v is not None}
        if "max_new_tokens" in data and _is_int(data["max_new_tokens"]) and data["max_new_tokens"] < 1:
            raise RequestError(f"max_tokens must be >= 1, got {data['max_new_tokens']}")
        try:
            return sampling_from(data)
        except RequestError as e:  # name the OpenAI field, not ours
            raise RequestError(str(e).replace("sampling_params.max_new_tokens", "max_tokens").replace("sampling_params.", "")) from e

    def requests(self, body: dict[str, Any], prompts: list[list[int]], top_k: int, logprobs: bool) -> list[GenerateRequest]:
        """n requests per prompt (seed + i for choice i when a seed is given), in choice order."""
        n = want(body, "n", int, 1)
        if n < 1 or n > 128:
            raise RequestError(f"n must be in [1, 128], got {n}")
        base = self.sampling(body)
        key = want(body, "routing_key", str) or None
        reqs = []
        for p, ids in enumerate(prompts):
            self.native.check_context(ids, base, "prompt" if len(prompts) == 1 else f"prompt[{p}]")
            for i in range(n):
                sampling = SamplingParams(**{**base.__dict__, "stop": list(base.stop), "stop_token_ids": list(base.stop_token_ids)})
                if base.seed is not None:
                    sampling.seed = base.seed + i
                reqs.append(GenerateRequest(ids, sampling, rid="", return_logprob=logprobs, top_logprobs_num=top_k, routing_key=key))
        return reqs

    def completion_prompts(self, body: dict[str, Any]) -> list[list[int]]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [self.native.tokenize(prompt, "prompt")]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return [self.native.tokenize(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            return [check_ids(p, f"prompt[{i}]", self.native.vocab_size) for i, p in enumerate(prompt)]
        if isinstance(prompt, list) and prompt and all(_is_int(p) for p in prompt):
            return [check_ids(prompt, "prompt", self.native.vocab_size)]
        if prompt in (None, "", []):
            raise RequestError("prompt is required and must not be empty")
        raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of those")

    def chat_prompt(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list of {role, content}")
        plain = [_chat_message(m, i) for i, m in enumerate(messages)]
        tok = self.s.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise RequestError("messages: this model's tokenizer has no chat template; use /v1/completions")
        add_gen = want(body, "add_generation_prompt", bool, True)
        text = tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_gen)
        # The template writes its own special tokens; adding a BOS on top would double it.
        ids = list(tok.encode(text, add_special_tokens=False))
        if not ids:
            raise RequestError("messages render to no tokens")
        return ids

    # ---------------------------------------------------------------------------- endpoints

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = drop_inert(await read_json(request), INERT_OPENAI)
        reject_unknown(body, self.COMPLETION)
        top_k = want(body, "logprobs", int)
        if top_k is not None and not 0 <= top_k <= 20:
            raise RequestError(f"logprobs must be in [0, 20], got {top_k}")
        prompts = self.completion_prompts(body)
        reqs = self.requests(body, prompts, top_k or 0, top_k is not None)
        render = _CompletionRender(self, reqs, top_k is not None)
        return await self._answer(request, body, reqs, render)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = drop_inert(await read_json(request), INERT_OPENAI)
        reject_unknown(body, self.CHAT)
        logprobs = want(body, "logprobs", bool, False)
        top_k = want(body, "top_logprobs", int, 0)
        if not 0 <= top_k <= 20:
            raise RequestError(f"top_logprobs must be in [0, 20], got {top_k}")
        if top_k and not logprobs:
            raise RequestError("top_logprobs needs logprobs: true")
        reqs = self.requests(body, [self.chat_prompt(body)], top_k, logprobs)
        render = _ChatRender(self, reqs, logprobs)
        return await self._answer(request, body, reqs, render)

    async def _answer(self, request: web.Request, body: dict[str, Any], reqs: list[GenerateRequest], render: Any) -> web.StreamResponse:
        if want(body, "stream", bool, False):
            return await self._stream(request, reqs, render)
        outs = await asyncio.gather(*(self.s.generate(r) for r in reqs))
        return web.json_response(render.full(outs))

    async def _stream(self, request: web.Request, reqs: list[GenerateRequest], render: Any) -> web.StreamResponse:
        """Merge the requests' partial outputs into one SSE stream of OpenAI chunks."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, req: GenerateRequest) -> None:
            try:
                async for part in self.s.stream(req):
                    await queue.put((index, part))
            finally:
                await queue.put((index, None))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
        try:
            response = await _sse_response(request)
            done, finals = 0, [None] * len(reqs)
            while done < len(reqs):
                index, part = await queue.get()
                if part is None:
                    done += 1
                    continue
                finals[index] = part
                if chunk := render.chunk(index, part):
                    await _sse(response, chunk)
            for t in tasks:
                t.result()  # re-raise an engine error
            await _sse(response, render.usage_chunk(finals))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            for t in tasks:
                t.cancel()


def _chat_message(message: Any, i: int) -> dict[str, str]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be an object with role and content")
    role, content = message.get("role"), message.get("content")
    if role not in ("system", "user", "assistant", "developer", "tool"):
        raise RequestError(f"{where}.role must be system, user, assistant or tool, got {role!r}")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.content[{j}]: only text parts are supported")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string or a list of text parts")
    return {"role": role, "content": content}


def _finish(out: GenerateOutput) -> str | None:
    if out.finish_reason is None:
        return None
    kind = out.finish_reason.get("type")
    return kind if kind in ("stop", "length") else "abort"


def _visible_text(out: GenerateOutput) -> str:
    """The output text without a matched stop string at its end (OpenAI does not return it)."""
    matched = (out.finish_reason or {}).get("matched")
    text = out.text
    if isinstance(matched, str) and matched and matched in text:
        text = text[: text.rindex(matched)]
    return text


@dataclass
class _Render:
    """Shared parts of the OpenAI renderers: ids, usage, per-choice stream offsets."""

    api: OpenAIApi
    reqs: list[GenerateRequest]
    logprobs: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    sent_text: dict[int, int] = field(default_factory=dict)
    sent_tokens: dict[int, int] = field(default_factory=dict)

    def usage(self, outs: list[GenerateOutput | None]) -> dict[str, int]:
        prompt = sum(len(r.input_ids) for r in self.reqs)
        completion = sum(len(o.output_ids) for o in outs if o is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def version(self, outs: list[GenerateOutput | None]) -> int:
        versions = [o.weight_version for o in outs if o is not None and o.weight_version is not None]
        return max(versions) if versions else self.api.s.engine.weight_version

    def envelope(self, kind: str, choices: list[dict[str, Any]], outs: list[GenerateOutput | None]) -> dict[str, Any]:
        return {
            "id": f"{kind[:4]}-{self.id}", "object": kind, "created": self.created,
            "model": self.api.native.model_name, "choices": choices,
            "weight_version": self.version(outs), "engine_id": self.api.s.engine_id,
        }  # fmt: skip

    def delta(self, index: int, part: GenerateOutput) -> tuple[str, int, int]:
        """New text and the new token range of a cumulative partial output."""
        text = part.text if part.finished is False else _visible_text(part)
        start_text, start_tok = self.sent_text.get(index, 0), self.sent_tokens.get(index, 0)
        self.sent_text[index], self.sent_tokens[index] = len(text), len(part.output_ids)
        return text[start_text:], start_tok, len(part.output_ids)

    def token_ids_extra(self, out: GenerateOutput, start: int = 0, end: int | None = None) -> dict[str, Any]:
        return {"token_ids": out.output_ids[start:end], "weight_versions": out.weight_versions[start:end]}


class _CompletionRender(_Render):
    def logprob_block(self, out: GenerateOutput, start: int = 0, end: int | None = None) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        tok = self.api.s.engine.tokenizer
        ids = out.output_ids[start:end]
        tops = (out.top_logprobs or [])[start:end]
        return {
            "tokens": _token_texts(tok, ids),
            "token_logprobs": out.logprobs[start:end],
            "top_logprobs": [{t: lp for t, lp in zip(_token_texts(tok, [i for i, _ in step]), [lp for _, lp in step])} for step in tops]
            or None,
            "text_offset": None,
        }

    def full(self, outs: list[GenerateOutput]) -> dict[str, Any]:
        choices = [
            {"index": i, "text": _visible_text(o), "logprobs": self.logprob_block(o), "finish_reason": _finish(o), **self.token_ids_extra(o)}
            for i, o in enumerate(outs)
        ]
        return {**self.envelope("text_completion", choices, outs), "usage": self.usage(outs)}

    def chunk(self, index: int, part: GenerateOutput) -> dict[str, Any] | None:
        text, start, end = self.delta(index, part)
        if not text and start == end and not part.finished:
            return None
        choice = {"index": index, "text": text, "logprobs": self.logprob_block(part, start, end), "finish_reason": _finish(part), **self.token_ids_extra(part, start, end)}
        return self.envelope("text_completion", [choice], [part])

    def usage_chunk(self, outs: list[GenerateOutput | None]) -> dict[str, Any]:
        return {**self.envelope("text_completion", [], outs), "usage": self.usage(outs)}


class _ChatRender(_Render):
    def logprob_block(self, out: GenerateOutput, start: int = 0, end: int | None = None) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        tok = self.api.s.engine.tokenizer
        ids, lps = out.output_ids[start:end], out.logprobs[start:end]
        tops = (out.top_logprobs or [])[start:end] or [[] for _ in ids]
        content = []
        for t, text, lp, step in zip(ids, _token_texts(tok, ids), lps, tops):
            top = [{"token": s, "logprob": l, "bytes": list((s or "").encode())} for s, l in zip(_token_texts(tok, [i for i, _ in step]), [l for _, l in step])]
            content.append({"token": text, "logprob": lp, "bytes": list((text or "").encode()), "top_logprobs": top, "id": t})
        return {"content": content}

    def full(self, outs: list[GenerateOutput]) -> dict[str, Any]:
        choices = [
            {"index": i, "message": {"role": "assistant", "content": _visible_text(o)}, "logprobs": self.logprob_block(o),
             "finish_reason": _finish(o), **self.token_ids_extra(o)}
            for i, o in enumerate(outs)
        ]  # fmt: skip
        prompt_ids = self.reqs[0].input_ids if self.reqs else []
        return {**self.envelope("chat.completion", choices, outs), "usage": self.usage(outs), "prompt_token_ids": prompt_ids}

    def chunk(self, index: int, part: GenerateOutput) -> dict[str, Any] | None:
        first = index not in self.sent_tokens
        text, start, end = self.delta(index, part)
        if not text and start == end and not part.finished and not first:
            return None
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": index, "delta": delta, "logprobs": self.logprob_block(part, start, end), "finish_reason": _finish(part), **self.token_ids_extra(part, start, end)}
        return self.envelope("chat.completion.chunk", [choice], [part])

    def usage_chunk(self, outs: list[GenerateOutput | None]) -> dict[str, Any]:
        return {**self.envelope("chat.completion.chunk", [], outs), "usage": self.usage(outs)}


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

        folder = model_path(name)  # a catalog entry is imported here on first use
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
