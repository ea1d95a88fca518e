"""``noria service``: the training API over HTTP (aiohttp), on Tinker's route names.

Every route but ``/api/v1/healthz`` needs the tenant's key in ``X-API-Key`` (as Tinker's SDK sends
it; ``Authorization: Bearer KEY`` is taken too): none is 401, an unknown one 403. Bodies are JSON.

    POST /api/v1/create_model              {base_model, lora_config: {rank, train_attn, train_mlp, target_modules, seed}}
    POST /api/v1/forward_backward          {model_id, forward_backward_input: {data, loss_fn, loss_fn_config}}
    POST /api/v1/forward                   {model_id, forward_input: {data, loss_fn}}  (no gradient)
    POST /api/v1/optim_step                {model_id, adam_params: {learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm}}
    POST /api/v1/save_weights              {model_id, path: NAME}  -> tinker://MODEL/weights/NAME (adapter + optimizer)
    POST /api/v1/load_weights              {model_id, path: tinker://..., optimizer: true}
    POST /api/v1/save_weights_for_sampler  {model_id, path: NAME}  -> tinker://MODEL/sampler_weights/NAME (a peft folder)
    POST /api/v1/unload_model              {model_id}
    POST /api/v1/asample                   {prompt, num_samples, sampling_params: {max_tokens, temperature, top_p, top_k, seed, stop},
                                            model_id (current weights) | model_path (saved for the sampler) | neither (base)}
    POST /api/v1/retrieve_future           {request_id}
    POST /api/v1/get_info                  {model_id}                  (answered at once)
    POST /api/v1/saved_state_info          {path}                      (answered at once: the LoRA config of a saved state)
    GET  /api/v1/get_server_capabilities   the base model

Each call but the last three answers ``{"request_id": ...}`` at once; ``retrieve_future`` then answers
the result, ``{"type": "try_again", ...}`` while it runs, or ``{"type": "request_failed", "error": ...,
"category": "user" | "server"}``. Errors of the request itself: 400 (bad body, naming the field),
401 / 403 (key), 404 (a model, future or path the tenant does not have: another tenant's included),
429 with ``Retry-After`` (a quota), 500 (a bug).

The server binds 127.0.0.1 unless told otherwise; beyond loopback every call still needs a key,
but the traffic is plain HTTP: put TLS in front of it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from noria.errors import NoriaError
from noria.net import DEFLATE_REFUSED, deflate_body
from noria.service.core import Service
from noria.service.state import NotFound
from noria.service.step import NonFiniteStep
from noria.service.tenants import QuotaExceeded, Tenant
from noria.service.wire import BadRequest

BODY_BYTES = 64 << 20
PREFIX = "/api/v1"


def _error(status: int, message: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status, headers=headers)


@web.middleware
async def _auth_and_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """A deflate body is refused unread (``noria.net.deflate_body``); the key names the tenant; the
    primitives' errors become their HTTP answers."""
    if deflate_body(request.headers):
        refused = _error(415, DEFLATE_REFUSED)
        refused.force_close()
        return refused
    if request.path != f"{PREFIX}/healthz":
        service: Service = request.app["service"]
        key = request.headers.get("X-API-Key") or request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not key:
            return _error(401, "no API key: send it as X-API-Key")
        tenant = service.registry.authenticate(key)
        if tenant is None:
            return _error(403, "this API key is not one of this service's tenants")
        request["tenant"] = tenant
    try:
        return await handler(request)
    except QuotaExceeded as e:
        return _error(429, str(e), {"Retry-After": str(max(1, math.ceil(e.retry_after_s)))})
    except NotFound as e:
        return _error(404, str(e))
    except BadRequest as e:
        return _error(400, str(e))
    except NoriaError as e:
        return _error(400, str(e))


async def _body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _future_route(method: Callable[[Service, Tenant, dict], str]) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        request_id = method(request.app["service"], request["tenant"], await _body(request))
        return web.json_response({"request_id": request_id})

    return handle


def _now_route(method: Callable[[Service, Tenant, dict], dict]) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        return web.json_response(method(request.app["service"], request["tenant"], await _body(request)))

    return handle


async def _retrieve(request: web.Request) -> web.Response:
    body = await _body(request)
    request_id = body.get("request_id")
    future = request.app["service"].scheduler.retrieve(request["tenant"], request_id if isinstance(request_id, str) else "")
    if future.state == "pending":
        return web.json_response({"type": "try_again", "request_id": request_id, "queue_state": "active"})
    if future.state == "failed":
        user = isinstance(future.error, (NoriaError, NonFiniteStep))
        message = str(future.error) if user else f"{type(future.error).__name__}: {future.error}"
        return web.json_response({"type": "request_failed", "error": message, "category": "user" if user else "server"})
    return web.json_response(future.result)


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _capabilities(request: web.Request) -> web.Response:
    return web.json_response({"supported_models": [{"model_name": request.app["service"].base_model}]})


def build_app(service: Service) -> web.Application:
    """The aiohttp application of ``service`` (its worker is started and stopped with the app)."""
    app = web.Application(middlewares=[_auth_and_errors], client_max_size=BODY_BYTES)
    app["service"] = service
    fb = _future_route(lambda s, t, b: s.forward_backward(t, b, backward=True))
    fwd = _future_route(lambda s, t, b: s.forward_backward(t, b, backward=False))
    app.add_routes([
        web.get(f"{PREFIX}/healthz", _healthz),
        web.get(f"{PREFIX}/get_server_capabilities", _capabilities),
        web.post(f"{PREFIX}/create_model", _future_route(Service.create_model)),
        web.post(f"{PREFIX}/forward_backward", fb),
        web.post(f"{PREFIX}/forward", fwd),
        web.post(f"{PREFIX}/optim_step", _future_route(Service.optim_step)),
        web.post(f"{PREFIX}/save_weights", _future_route(lambda s, t, b: s.save_weights(t, b, "weights"))),
        web.post(f"{PREFIX}/save_weights_for_sampler", _future_route(lambda s, t, b: s.save_weights(t, b, "sampler_weights"))),
        web.post(f"{PREFIX}/load_weights", _future_route(Service.load_weights)),
        web.post(f"{PREFIX}/unload_model", _future_route(Service.unload_model)),
        web.post(f"{PREFIX}/asample", _future_route(Service.sample)),
        web.post(f"{PREFIX}/retrieve_future", _retrieve),
        web.post(f"{PREFIX}/get_info", _now_route(Service.get_info)),
        web.post(f"{PREFIX}/saved_state_info", _now_route(lambda s, t, b: s.saved_spec(t, b.get("path")))),
    ])  # fmt: skip

    async def start(app: web.Application) -> None:
        service.scheduler.start()

    async def stop(app: web.Application) -> None:
        service.scheduler.stop()
        if service.sampler is not None:
            service.sampler.shutdown()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


def serve_service(config, host: str = "127.0.0.1", port: int = 8000) -> int:
    """Load the tenants and the base model, then serve until SIGTERM / Ctrl-C; the exit code."""
    from noria.console import say
    from noria.models.catalog import model_path
    from noria.service.adapters import MultiLora
    from noria.service.tenants import load_tenants

    registry, generated = load_tenants(config.service)
    folder = str(model_path(config.model.path))
    say(f"noria service: loading {folder} ({config.model.dtype} on {config.model.device}) ...")
    svc = config.service
    lora = MultiLora.load(folder, config.model.dtype, config.model.device, svc.activation_checkpointing, svc.logprob_chunk_tokens)
    sampler = None
    if config.service.sampler and config.service.placement == "disaggregated":
        from noria.service.sampler import HttpSampler

        where = config.service.engine_url or f"a noria serve child (its log: {Path(config.service.state_dir) / 'engine.log'})"
        say(f"noria service: sampling engine at {where} ...")
        sampler = HttpSampler.start(folder, config)
    elif config.service.sampler:
        from noria.service.sampler import Sampler

        sampler = Sampler.load(folder, config.engine, config.model.dtype, config.model.device)
    service = Service(lora, registry, config.service, base_model=config.model.path, sampler=sampler)
    if generated:
        say(f"noria service: tenant 'default' has the key {generated} (send it as X-API-Key)")
    say(f"noria service: {len(registry.tenants)} tenants; listening on http://{host}:{port}{PREFIX}")
    web.run_app(build_app(service), host=host, port=port, print=None, handle_signals=True)
    return 0
