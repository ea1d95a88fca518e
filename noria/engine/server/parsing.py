"""Request parsing of the engine server: JSON bodies into checked values, with errors naming the field.

What this module owns: reading a body as a JSON object, the fields SGLang and OpenAI clients send at
their defaults (accepted at those values, refused otherwise: ``drop_inert``), closed field sets
(``reject_unknown``), typed reads (``want``: bool is never an int), prompts of token ids
(``check_ids``), sampling parameters, and the small response helpers both APIs share (server-sent
events, per-token texts).

Every failure is a ``RequestError`` (HTTP 400 by the server's middleware) whose message names the
field. Nothing here touches the engine beyond reading its attributes (tokenizer, limits).
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from noria.engine.protocol import RequestError, SamplingParams
from noria.errors import NoriaError
from noria.net import DEFLATE_REFUSED, deflate_body

INVALID = "invalid_request"


class HttpError(Exception):
    """An error answered with a JSON body ``{"error": {"message", "type"}}`` and a status."""

    def __init__(self, status: int, message: str, kind: str, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.close = close
        """Close the connection after the answer (the request's body is left unread)."""


async def maybe_await(value: Any) -> Any:
    """``value``, awaited if it is awaitable (engine methods may be plain or async)."""
    return await value if inspect.isawaitable(value) else value


def refuse_deflate(request: web.Request) -> None:
    """Refuse a body sent with ``Content-Encoding: deflate`` (415, the connection closed after it),
    before anything reads it: ``noria.net.deflate_body`` says why."""
    if deflate_body(request.headers):
        raise HttpError(415, DEFLATE_REFUSED, INVALID, close=True)


async def read_json(request: web.Request, required: bool = True) -> dict[str, Any]:
    """The request body as a JSON object (an empty body is ``{}`` unless ``required``)."""
    try:
        raw = await request.read()
    except RequestPayloadError as e:  # a Content-Encoding the body does not have, a truncated chunk
        raise RequestError(f"the request body cannot be read: {e}") from e
    if not raw.strip():
        if required:
            raise RequestError("the request body is empty; expected a JSON object")
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from e
    except RecursionError as e:  # "[[[[..." thousands deep: the parser's stack, not the server's fault
        raise RequestError("the request body nests too deeply to parse") from e
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
    "return_bytes": False, "return_entropy": False, "custom_logit_processor": None,
    "session_params": None, "bootstrap_host": None,
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


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def want(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    """``body[name]`` checked against ``kind`` (bool is not an int here), or ``default`` if absent."""
    value = body.get(name, default)
    if value is None:
        return default
    if kind is int or (isinstance(kind, tuple) and int in kind and bool not in kind):
        if isinstance(value, bool):
            raise RequestError(f"{name} has the wrong type: expected {type_name(kind)}, got {value!r}")
    if kind is float and is_int(value):
        return float(value)
    if not isinstance(value, kind):
        raise RequestError(f"{name} has the wrong type: expected {type_name(kind)}, got {type(value).__name__}")
    return value


def type_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def check_ids(ids: Any, name: str, vocab_size: int | None) -> list[int]:
    """A prompt of token ids: a non-empty list of ints inside the vocabulary."""
    if not isinstance(ids, list) or not all(is_int(t) for t in ids):
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
    if data is not None and "sampling_seed" in data:  # SGLang's name of the seed (sglang-router passes only it on)
        if "seed" in data:
            raise RequestError(f"{name}: give seed or sampling_seed, not both")
        data = {**data, "seed": data["sampling_seed"]}
        del data["sampling_seed"]
    try:
        return SamplingParams.from_dict(data)
    except TypeError as e:  # e.g. a field given a value the dataclass cannot take
        raise RequestError(f"{name}: {e}") from e


def per_item(value: Any, n: int, name: str, kind: type) -> list[Any]:
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


def encode_text(tokenizer: Any, text: str, name: str, **kwargs: Any) -> list[int]:
    """``tokenizer.encode(text)``; text it cannot take (a lone surrogate) is a ``RequestError`` naming the field."""
    try:
        return list(tokenizer.encode(text, **kwargs))
    except (TypeError, ValueError) as e:
        raise RequestError(f"{name} cannot be tokenized ({type(e).__name__}: {e}); send valid Unicode text") from e


def engine_attr(engine: Any, name: str) -> Any:
    value = getattr(engine, name, None)
    return value() if callable(value) else value


def token_texts(tokenizer: Any, ids: list[int]) -> list[str | None]:
    if tokenizer is None:
        return [None] * len(ids)
    return [tokenizer.decode([t]) for t in ids]


async def sse_response(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def sse(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


async def sse_error(response: web.StreamResponse, error: BaseException) -> None:
    """An error raised after a stream's 200 went out (a request the engine refuses once admitted):
    the stream's last event, as SGLang sends it; an error answer there would corrupt the stream."""
    status, kind = (400, INVALID) if isinstance(error, (RequestError, NoriaError)) else (500, "internal_error")
    await sse(response, {"error": {"message": f"{type(error).__name__}: {error}" if status == 500 else str(error), "type": kind, "code": status}})
