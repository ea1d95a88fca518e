"""SGLang's native API of the engine server: generation, status and control endpoints.

``/generate`` (one prompt or a batch, ``text`` or ``input_ids``, images of a vision-language model as
SGLang's ``image_data``: data URLs or base64, never fetched; optional streaming as server-sent events), ``/health``, ``/health_generate`` (a real one-token generation), ``/server_info`` and
``/model_info`` (also under their ``/get_`` names, which sglang-router falls back to),
``/get_load``, ``/metrics`` (Prometheus text), ``/get_weight_version``, ``/flush_cache``,
``/pause_generation`` / ``/continue_generation``, ``/abort_request``, and SGLang's
``/release_memory_occupation`` / ``/resume_memory_occupation`` (free and re-allocate the KV cache).
The weight-update endpoints are :mod:`noria.engine.server.weights_api`; the LoRA adapter ones
:mod:`noria.engine.server.lora_api` (``/generate`` names a request's adapter with ``lora_path``).

Responses follow SGLang's shapes (``text``, ``output_ids``, ``meta_info`` with the engine id and the
weight version that produced the tokens; with ``return_routed_experts`` on a MoE model, SGLang's
``routed_experts``, base64 of int32 ids, with ``routed_experts_shape`` [output tokens, MoE layers,
top-k]: one row per output token, where SGLang sends one per position). Blocking: generation is awaited on the event loop; cache
flushes and memory release run in a thread (``EngineServer.blocking``).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from noria.engine.protocol import GenerateOutput, GenerateRequest, RequestError, SamplingParams
from noria.engine.vision import ImagePrompts
from noria.engine.server.lora_api import LoraApi
from noria.engine.server.parsing import (
    HttpError,
    INERT_NATIVE,
    check_ids,
    drop_inert,
    encode_text,
    engine_attr,
    maybe_await,
    per_item,
    read_json,
    reject_unknown,
    sampling_from,
    sse,
    sse_error,
    sse_response,
    token_texts,
    want,
)

if TYPE_CHECKING:
    from noria.engine.server.app import EngineServer

ONE_TOKEN = {"max_new_tokens": 1, "temperature": 0.0}
HEALTH_RID = "health-"
"""Request ids of ``/health_generate``'s own generations (``abort_all`` leaves them alone)."""


class NativeApi:
    """SGLang's native endpoints."""

    GENERATE_FIELDS = {
        "text", "input_ids", "sampling_params", "rid", "return_logprob", "top_logprobs_num", "stream",
        "return_text_in_logprobs", "routing_key", "return_routed_experts", "logprob_start_len", "image_data", "priority",
        "lora_path",
    }  # fmt: skip

    def __init__(self, server: EngineServer) -> None:
        self.s = server
        self._images: ImagePrompts | None = None

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
            "/release_memory_occupation": ("POST", self.release_memory_occupation),
            "/resume_memory_occupation": ("POST", self.resume_memory_occupation),
        }
        for path, (method, handler) in routes.items():
            router.add_route(method, path, handler)
            # SGLang answers GET and POST on most control endpoints; clients use either.
            router.add_route("POST" if method == "GET" else "GET", path, handler)
        LoraApi(self.s).register(router)

    # ------------------------------------------------------------------------------ /generate

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = drop_inert(await read_json(request), INERT_NATIVE)
        reject_unknown(body, self.GENERATE_FIELDS)
        if body.get("image_data") is not None:  # decoding and resizing images: off the event loop
            reqs, batched = await asyncio.to_thread(self.parse_generate, body)
        else:
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
        samplings = per_item(body.get("sampling_params"), n, "sampling_params", dict)
        rids = per_item(body.get("rid"), n, "rid", str)
        logprobs = per_item(body.get("return_logprob"), n, "return_logprob", bool)
        top_k = want(body, "top_logprobs_num", int, 0)
        if top_k < 0:
            raise RequestError(f"top_logprobs_num must be >= 0, got {top_k}")
        key = want(body, "routing_key", str) or None
        routed = per_item(body.get("return_routed_experts"), n, "return_routed_experts", bool)
        starts = per_item(body.get("logprob_start_len"), n, "logprob_start_len", int)
        priority = want(body, "priority", int, 0)  # SGLang's: larger is admitted first
        adapters = per_item(body.get("lora_path"), n, "lora_path", str)  # SGLang's: the adapter's name
        if any(adapters) and not hasattr(self.s.engine, "load_adapter"):
            raise RequestError(f"lora_path: this engine ({type(self.s.engine).__name__}) serves no LoRA adapters")
        images: list[list] = [[] for _ in prompts]
        if body.get("image_data") is not None:
            prompts, images = self.image_prompts(body, prompts, batched)
        reqs = []
        for i, ids in enumerate(prompts):
            where = f"sampling_params[{i}]" if isinstance(body.get("sampling_params"), list) else "sampling_params"
            sampling = sampling_from(samplings[i], where)
            self.check_context(ids, sampling, f"input_ids[{i}]" if batched else "input_ids")
            reqs.append(GenerateRequest(
                input_ids=ids, sampling=sampling, rid=rids[i] or "",
                return_logprob=True if logprobs[i] is None else logprobs[i],
                top_logprobs_num=top_k, routing_key=key, return_routed_experts=bool(routed[i]),
                logprob_start_len=-1 if starts[i] is None else starts[i], images=images[i], priority=priority,
                adapter=adapters[i] or None,
            ))  # fmt: skip
        return reqs, batched

    def images(self) -> ImagePrompts:
        """The image path of a vision-language model (``noria.engine.vision``), made on first use."""
        if self._images is None:
            self._images = ImagePrompts(getattr(self.s.engine, "model", None), self.s.model_path)
        return self._images

    def image_prompts(self, body: dict[str, Any], prompts: list[list[int]], batched: bool) -> tuple[list[list[int]], list[list]]:
        """SGLang's ``image_data`` (one prompt: a data URL / base64 string or a list of them; a batch:
        one such entry, or null, per prompt): the prompts' ids (a text's ``<image>`` s expanded) and images."""
        data = body["image_data"]
        per_prompt = data if batched else [data]
        if batched and (not isinstance(data, list) or len(data) != len(prompts)):
            raise RequestError(f"image_data: a batch of {len(prompts)} prompts needs a list with one entry (or null) per prompt")
        texts = body.get("text")
        out_ids, out_images = [], []
        for i, (ids, value) in enumerate(zip(prompts, per_prompt)):
            name = f"image_data[{i}]" if batched else "image_data"
            if value is None:
                out_ids.append(ids)
                out_images.append([])
                continue
            decoded = self.images().decode(value, name)
            if texts is not None:
                text = texts[i] if batched else texts
                ids, inputs = self.images().from_text(text, decoded, name)
            else:
                inputs = self.images().from_ids(ids, decoded, name)
            out_ids.append(ids)
            out_images.append(inputs)
        return out_ids, out_images

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
        ids = encode_text(tok, text, name)
        if not ids:
            raise RequestError(f"{name} is empty: a prompt needs at least one token")
        return ids

    @property
    def vocab_size(self) -> int | None:
        return engine_attr(self.s.engine, "vocab_size")

    def check_context(self, ids: list[int], sampling: SamplingParams, name: str) -> None:
        limit = engine_attr(self.s.engine, "max_context")
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
            info.pop("input_token_logprobs", None)
            info.pop("input_top_logprobs", None)
        elif with_text:
            self._add_token_text(info, out)
        return {"text": out.text, "output_ids": out.output_ids, "meta_info": info}

    def _add_token_text(self, info: dict[str, Any], out: GenerateOutput) -> None:
        texts = token_texts(self.s.engine.tokenizer, out.output_ids)
        for entry, t in zip(info.get("output_token_logprobs", []), texts):
            entry[2] = t
        for entry, t in zip(info.get("input_token_logprobs", []), token_texts(self.s.engine.tokenizer, [e[1] for e in info.get("input_token_logprobs", [])])):
            entry[2] = t
        for step in [*(info.get("output_top_logprobs") or []), *(s for s in info.get("input_top_logprobs") or [] if s)]:
            for entry, t in zip(step, token_texts(self.s.engine.tokenizer, [e[1] for e in step])):
                entry[2] = t

    async def _stream(self, request: web.Request, req: GenerateRequest, with_text: bool) -> web.StreamResponse:
        with self.s.claim(req):  # a request id in flight is a 400 here, not a stream cut after its 200
            response = await sse_response(request)
            try:
                async for part in self.s.stream(req, claimed=True):
                    await sse(response, self.result(req, part, with_text))
            except (ConnectionResetError, asyncio.CancelledError):
                raise  # the client went away
            except Exception as e:  # noqa: BLE001 -- classified: after the 200, the error is the stream's last event
                await sse_error(response, e)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # ------------------------------------------------------------------------------- status

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def health_generate(self, request: web.Request) -> web.Response:
        """A real one-token greedy generation through the scheduler."""
        token = 0 if self.s.engine.tokenizer is None else _first_token(self.s.engine.tokenizer)
        req = GenerateRequest(input_ids=[token], sampling=SamplingParams(**ONE_TOKEN), rid=f"{HEALTH_RID}{self.s.new_rid()}")
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
            "max_context": engine_attr(e, "max_context"),
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
            "has_image_understanding": getattr(getattr(self.s.engine, "model", None), "vision", None) is not None,
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
        load = dict(await maybe_await(self.s.engine.get_load()) or {})
        load.setdefault("num_inflight_http", len(self.s.inflight))
        load["weight_version"] = self.s.engine.weight_version
        return web.json_response(load)

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.s.engine.weight_version})

    async def metrics(self, request: web.Request) -> web.Response:
        metrics = dict(await maybe_await(self.s.engine.metrics()) or {})
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
        await maybe_await(self.s.engine.pause(mode=mode))
        return web.json_response({"success": True, "message": f"paused ({mode})"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await read_json(request, required=False)
        await maybe_await(self.s.engine.resume())
        return web.json_response({"success": True, "message": "resumed"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        reject_unknown(body, {"rid", "abort_all"})
        rid = want(body, "rid", str, "")
        if want(body, "abort_all", bool, False):  # every client request; not the server's own health probe
            rids = [r for r in self.s.inflight if not r.startswith(HEALTH_RID)]
        elif rid:
            rids = [rid]
        else:
            raise RequestError("rid: give the request id to abort (or abort_all: true)")
        for r in rids:
            await maybe_await(self.s.engine.abort(r))
        return web.json_response({"success": True, "aborted": rids})

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        await read_json(request, required=False)
        await self.s.blocking(self.s.engine.release_memory_occupation)
        return web.json_response({"success": True, "message": "KV cache released"})

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        await read_json(request, required=False)
        await self.s.blocking(self.s.engine.resume_memory_occupation)
        return web.json_response({"success": True, "message": "KV cache allocated"})


def _as_dict(config: Any) -> Any:
    import dataclasses

    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else None


def _first_token(tokenizer: Any) -> int:
    ids = tokenizer.encode("a", add_special_tokens=False)
    return ids[0] if ids else 0


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
