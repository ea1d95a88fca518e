"""What the session server refuses, and how: its per-run bounds and the bodies it cannot read.

What this module owns: ``SessionLimits`` (the three bounds of ``rollout.session_*``),
``SessionCounters`` (what a run's session servers counted, logged as the ``session/*`` metrics),
the check of a chat request body before anything is recorded or sent (``read_body``,
``check_body``: ``BadRequest`` naming the field, answered 400; ``refuse_deflate``, the middleware
that answers a deflate-encoded body 415 unread), and the OpenAI-shaped error body
every refusal uses (``error_response``: ``param`` names the option behind a bound, ``limit`` its
value). ``noria.agent.session`` applies them; its docstring says which answer each bound gives.

Not guaranteed: the check covers the types the server itself reads (``messages`` and their
``role``, ``content`` and ``tool_calls``, ``tools``, ``chat_template_kwargs``, ``max_tokens``,
``stop``, ``stream``); what a chat template does with the rest of a message is the template's.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from noria.errors import NoriaError
from noria.net import DEFLATE_REFUSED, deflate_body


class BadRequest(NoriaError):
    """A request body the session server cannot read (answered 400 naming the field)."""


@dataclass(frozen=True)
class SessionLimits:
    """The session server's bounds (``noria.agent.session``'s docstring); None is no bound."""

    max_open: int | None = None
    """Sessions holding a place at once, over every server of the run (``rollout.session_max_open``)."""
    max_tokens: int | None = None
    """Tokens of one session's record, prompt and response (``rollout.session_max_tokens``)."""
    idle_timeout_s: float | None = None
    """Seconds a session may go without a request in flight (``rollout.session_idle_timeout_s``)."""

    @classmethod
    def from_rollout(cls, rollout: Any) -> SessionLimits:
        """The bounds a rollout config sets (a config without them sets none)."""
        return cls(*(getattr(rollout, f"session_{k}", None) for k in ("max_open", "max_tokens", "idle_timeout_s")))


@dataclass
class SessionCounters:
    """What a run's session servers counted: ``open`` now, the rest since the run started."""

    open: int = 0
    admitted: int = 0
    refused_open: int = 0
    refused_tokens: int = 0
    closed_idle: int = 0

    def metrics(self) -> dict[str, float]:
        """The ``session/*`` metrics (documented in ``noria.metric_names.METRICS``)."""
        return {
            "session/open": float(self.open), "session/admitted": float(self.admitted),
            "session/refused_open": float(self.refused_open), "session/refused_tokens": float(self.refused_tokens),
            "session/closed_idle": float(self.closed_idle),
        }  # fmt: skip


def error_response(status: int, code: str, message: str, param: str | None = None, limit: Any = None,
                   kind: str = "invalid_request_error") -> web.Response:  # fmt: skip
    """An OpenAI error body; ``param`` names the option behind a bound and ``limit`` its value."""
    error: dict[str, Any] = {"code": code, "message": message, "type": kind, "param": param}
    if param is not None:
        error["limit"] = limit
    return web.json_response({"error": error}, status=status)


@web.middleware
async def refuse_deflate(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """A deflate-encoded body is answered 415 unread, and its connection closed (``noria.net.deflate_body`` says why)."""
    if not deflate_body(request.headers):
        return await handler(request)
    response = error_response(415, "unsupported_encoding", DEFLATE_REFUSED)
    response.force_close()
    return response


async def read_body(request: web.Request) -> Any:
    """The body as JSON (``BadRequest`` if it is not UTF-8 JSON); a body past the server's size
    limit raises aiohttp's 413 as it is read."""
    try:
        raw = await request.read()
    except RequestPayloadError as e:  # a Content-Encoding the body does not have, a truncated chunk
        raise BadRequest(f"the body cannot be read: {e}") from e
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not JSON: {e}") from e
    except RecursionError as e:
        raise BadRequest("the body nests too deeply to parse") from e


RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip
"""``apply_chat_template``'s own parameters: the server sets them, ``chat_template_kwargs`` may not."""


def check_body(body: Any) -> dict[str, Any]:
    """``body`` if every field the server reads has its type; else ``BadRequest`` naming the field."""
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    for i, message in enumerate(messages):
        check_message(message, f"messages[{i}]")
    for name, kind in (("tools", list), ("chat_template_kwargs", dict), ("stream", bool)):
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise BadRequest(f"{name} must be a {kind.__name__}, got {type(body[name]).__name__}")
    if not all(isinstance(t, dict) for t in body.get("tools") or []):
        raise BadRequest("tools must be a list of objects")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(body.get("chat_template_kwargs") or {}))
    if reserved:
        raise BadRequest(f"chat_template_kwargs may not set {reserved}: the server sets them")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise BadRequest(f"{name} must be an integer >= 1, got {value!r}")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (isinstance(stop, list) and all(isinstance(x, str) for x in stop)):
        raise BadRequest("stop must be a string or a list of strings")
    return body


def check_message(message: Any, where: str) -> None:
    """One chat message: an object with a string role, string/list/null content, a list of tool calls."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRequest(f"{where} must be an object with a string role")
    content = message.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise BadRequest(f"{where}.content must be a string, a list of parts or null, got {type(content).__name__}")
    calls = message.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function", c), dict) for c in calls):
        raise BadRequest(f"{where}.tool_calls must be a list of objects (each with a function object)")
