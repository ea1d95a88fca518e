"""The session server: OpenAI chat completions per session, recorded token-in-token-out.

What it owns: one ``Session`` per trajectory (its token record) and a small aiohttp server on
127.0.0.1 that agent functions talk to with any OpenAI client at
``http://127.0.0.1:PORT/<secret>/sessions/<id>/v1`` (``base_url(id)``; ``POST .../chat/completions``;
``tools``, ``tool_calls`` and ``stream`` supported, a stream is answered as one chunk). ``<secret>``
is random per server: another local process that finds the port still cannot reach a session
(every path without it is 404), and agent functions need nothing but the URL they are given.

How data moves, per request::

    messages --(first turn) render whole with the chat template---------------------> ids
             --(later turns) check the history against the record, then render only
               the appended messages (ChatFormat.appended_ids), append them (mask 0) --> ids
    ids --engine.generate (routing key = session id)--> output ids, logprobs, version (mask 1)
        --parse (thinking, tool calls)--> OpenAI assistant message

The record is never re-tokenized: the ids sent to the engine are the record, and the record is
what ``Session.fill(sample)`` turns into a ``Sample`` (policy tokens mask 1 with the engine's
logprobs and weight versions; template, tool and environment tokens mask 0, logprob 0.0,
version -1). So the trainer sees exactly the tokens the policy sampled.

History check: the messages a client re-sends must equal what the session recorded (roles,
contents, tool calls; ``reasoning_content`` may be dropped). A mismatch (the client edited or
re-rendered its history) is handled by ``on_mismatch``: ``"error"`` (default) answers HTTP 409 and
marks the session failed; ``"rerender"`` starts the record over from the client's history
rendered whole (earlier policy tokens leave the trajectory; counted in ``metadata``).

Sampling: temperature, top-p, top-k and min-p come from the server's ``SamplingParams`` (the
rollout config), never from the request, because the trainer recomputes log-probabilities at the
rollout temperature; a request may lower ``max_tokens`` and add ``stop`` strings.

An engine that refuses a request (too long for its context: ``RequestError`` in process, HTTP 4xx
from a server) answers the agent 400 and ends the trajectory as TRUNCATED; any other engine error
is kept and re-raised by the rollout after the agent returns (it stops the step).

Routing: every engine request carries the session id as routing key; a request that names no
session is refused (HTTP 400) before it reaches an engine or a router.

Not guaranteed: a session is one linear conversation (no branching, ``n`` = 1); requests of one
session are serialized; whoever is given a session's URL (the agent function) can use it.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from aiohttp import web

from noria.agent.chat_format import ChatFormat, TemplateError
from noria.engine.protocol import GenerateOutput, GenerateRequest, RequestError, SamplingParams
from noria.errors import NoriaError
from noria.router.client import MissingRoutingKey, routing_headers
from noria.types import Sample, Status

OnMismatch = Literal["error", "rerender"]


class HistoryMismatch(NoriaError):
    """The client's re-sent history differs from what the session recorded."""


class ContextExceeded(NoriaError):
    """The session's tokens would exceed ``max_total_tokens``."""


@dataclass
class Session:
    """The token record of one conversation."""

    id: str
    fmt: ChatFormat
    sampling: SamplingParams
    on_mismatch: OnMismatch = "error"
    max_total_tokens: int | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation as recorded: the client's messages and the assistant messages returned."""
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routes: list[Any] = field(default_factory=list)
    """Per response token, its MoE route [L, k] (policy tokens, when the server asks for routes) or None."""
    turns: int = 0
    last_finish: str | None = None
    cached_tokens: int = 0
    prompt_tokens: int = 0
    unparsable_tool_calls: int = 0
    rerenders: int = 0
    dropped_policy_tokens: int = 0
    error: str | None = None
    engine_failure: NoriaError | None = None
    engine_outputs: list[list[int]] = field(default_factory=list)
    """The engine's output ids of every turn, as received (for checks and inspection)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def input_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None, kwargs: dict[str, Any]) -> list[int]:
        """The ids to send for this request; appends the non-policy tokens to the record."""
        if not self.prompt_ids:
            self.prompt_ids = self.fmt.first_ids(messages, tools, **kwargs)
            self.messages = [dict(m) for m in messages]
            return self.ids
        known = len(self.messages)
        if len(messages) <= known or not same_history(messages[:known], self.messages):
            if self.on_mismatch == "error":
                raise HistoryMismatch(history_diff(messages, self.messages))
            self.rerenders += 1
            self.dropped_policy_tokens += sum(self.loss_mask)
            self.response_ids, self.loss_mask, self.logprobs, self.versions, self.routes = [], [], [], [], []
            self.prompt_ids = []
            return self.input_ids(messages, tools, kwargs)
        appended = messages[known:]
        ids = self.fmt.appended_ids(appended, tools, **kwargs)
        if not self.response_ids or self.response_ids[-1] != self.fmt.end_of_turn_id:
            ids = [self.fmt.end_of_turn_id, *ids]  # the last turn stopped without closing (length or stop string)
        self.append(ids)
        self.messages.extend(dict(m) for m in appended)
        return self.ids

    def append(self, ids: list[int], out: GenerateOutput | None = None) -> None:
        """Append ``ids``: the engine's (mask 1, with logprobs) when ``out`` is given, else mask 0."""
        self.response_ids += ids
        if out is None:
            self.loss_mask += [0] * len(ids)
            self.logprobs += [0.0] * len(ids)
            self.versions += [-1] * len(ids)
            self.routes += [None] * len(ids)
        else:
            self.loss_mask += [1] * len(ids)
            self.logprobs += [float(x) for x in out.logprobs]
            self.versions += [int(v) for v in out.weight_versions]
            self.routes += list(out.routed_experts) if out.routed_experts is not None else [None] * len(ids)

    def record(self, out: GenerateOutput) -> dict[str, Any]:
        """Record the engine's turn; return the OpenAI choice for it."""
        ids = list(out.output_ids)
        self.engine_outputs.append(ids)
        self.append(ids, out)
        self.turns += 1
        self.cached_tokens += out.cached_tokens
        self.prompt_tokens += out.prompt_tokens
        reason = (out.finish_reason or {}).get("type")
        self.last_finish = reason
        text = self.fmt.tokenizer.decode(ids, skip_special_tokens=False)
        parsed = self.fmt.parse_assistant(text)
        self.unparsable_tool_calls += len(parsed.unparsable_tool_calls)
        message = parsed.message()
        self.messages.append(message)
        finish = "length" if reason == "length" else "tool_calls" if parsed.tool_calls else "stop"
        choice = {"index": 0, "message": message, "finish_reason": finish}
        if parsed.unparsable_tool_calls:
            choice["noria_unparsable_tool_calls"] = parsed.unparsable_tool_calls
        return choice

    def fill(self, sample: Sample) -> Sample:
        """Write the record into ``sample`` (tokens, mask, logprobs, versions, session id)."""
        sample.prompt_ids = list(self.prompt_ids)
        sample.response_ids = list(self.response_ids)
        sample.loss_mask = list(self.loss_mask)
        sample.rollout_logprobs = list(self.logprobs)
        sample.weight_versions = list(self.versions)
        sample.routed_experts = self.routed_experts()
        sample.session_id = self.id
        sample.response_text = self.fmt.tokenizer.decode(self.response_ids, skip_special_tokens=False)
        sample.metadata.update({
            "turns": self.turns,
            "cached_tokens": self.cached_tokens,
            "session_prompt_tokens": self.prompt_tokens,
            "unparsable_tool_calls": self.unparsable_tool_calls,
            "rerenders": self.rerenders,
            "dropped_policy_tokens": self.dropped_policy_tokens,
        })  # fmt: skip
        return sample

    def routed_experts(self) -> Any:
        """The routes of the response [R, L, k], -1 rows for tokens without one; None if none has."""
        known = next((r for r in self.routes if r is not None), None)
        if known is None:
            return None
        import torch

        return torch.stack([r if r is not None else torch.full_like(known, -1) for r in self.routes])

    def request_sampling(self, body: dict[str, Any]) -> SamplingParams:
        cap = self.sampling.max_new_tokens
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or cap
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        new = min(int(asked), cap)
        if self.max_total_tokens is not None:
            room = self.max_total_tokens - len(self.ids)
            if room < 1:
                raise ContextExceeded(f"session {self.id} holds {len(self.ids)} tokens; max_total_tokens is {self.max_total_tokens}")
            new = min(new, room)
        seed = self.sampling.seed
        if seed is not None:
            seed = (seed + 7_919 * self.turns) % (1 << 62)  # a distinct, reproducible seed per turn
        return replace(self.sampling, max_new_tokens=new, stop=[*self.sampling.stop, *stop], seed=seed)


def _normal(message: dict[str, Any]) -> tuple[Any, ...]:
    calls = []
    for call in message.get("tool_calls") or []:
        f = call.get("function", call)
        args = f.get("arguments", {})
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass
        calls.append((f.get("name"), json.dumps(args, sort_keys=True)))
    content = message.get("content")
    return (message.get("role"), (content or "").strip() if isinstance(content, str) else content, tuple(calls))


def same_history(sent: list[dict[str, Any]], recorded: list[dict[str, Any]]) -> bool:
    return len(sent) == len(recorded) and all(_normal(a) == _normal(b) for a, b in zip(sent, recorded))


def history_diff(sent: list[dict[str, Any]], recorded: list[dict[str, Any]]) -> str:
    if len(sent) <= len(recorded):
        return f"the request holds {len(sent)} messages but the session already recorded {len(recorded)}; append new ones"
    for i, (a, b) in enumerate(zip(sent, recorded)):
        if _normal(a) != _normal(b):
            return f"message {i} differs from the recorded one: sent {_normal(a)!r}, recorded {_normal(b)!r}"
    return "history differs"


async def session_generate(engine: Any, req: GenerateRequest) -> GenerateOutput:
    """``engine.generate`` for a session request: the routing key is required and sent."""
    routing_headers(req.routing_key, session=True)  # raises MissingRoutingKey before anything is sent
    pick = getattr(engine, "pick", None)
    if pick is not None:  # LocalRouter: session semantics
        return await engine.generate(req, session=True)
    return await engine.generate(req)


class SessionServer:
    """OpenAI chat completions on 127.0.0.1 for the sessions a rollout opens."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        sampling: SamplingParams,
        on_mismatch: OnMismatch = "error",
        max_total_tokens: int | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        routes: bool = False,
    ) -> None:
        if on_mismatch not in ("error", "rerender"):
            raise ValueError(f"on_mismatch must be 'error' or 'rerender', got {on_mismatch!r}")
        self.engine = engine
        self.fmt = ChatFormat(tokenizer)
        self.sampling = sampling
        self.on_mismatch: OnMismatch = on_mismatch
        self.max_total_tokens = max_total_tokens
        self.routes = routes
        """Ask the engine for each policy token's MoE route (``rollout.routing_replay`` / ``record_routes``)."""
        self.host, self.port = host, port
        self.sessions: dict[str, Session] = {}
        self.runner: web.AppRunner | None = None
        self.secret = secrets.token_urlsafe(24)
        """The first path segment of every URL this server answers (see the module docstring)."""

    # ------------------------------------------------------------------------------ lifecycle

    async def start(self) -> SessionServer:
        app = web.Application()
        root = f"/{self.secret}"
        app.router.add_post(root + "/sessions/{sid}/v1/chat/completions", self.chat)
        app.router.add_post(root + "/v1/chat/completions", self.chat)
        app.router.add_get(root + "/sessions/{sid}", self.show)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def __aenter__(self) -> SessionServer:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        """The server's root, its secret included."""
        return f"http://{self.host}:{self.port}/{self.secret}"

    def open(self, session_id: str | None = None, seed: int | None = None) -> Session:
        """A new session; its OpenAI base URL is ``base_url(session.id)``."""
        sid = session_id or uuid.uuid4().hex
        if sid in self.sessions:
            raise ValueError(f"session {sid} is already open")
        sampling = replace(self.sampling, seed=seed if seed is not None else self.sampling.seed)
        self.sessions[sid] = Session(sid, self.fmt, sampling, self.on_mismatch, self.max_total_tokens)
        return self.sessions[sid]

    def base_url(self, session_id: str) -> str:
        return f"{self.url}/sessions/{session_id}/v1"

    def close(self, session_id: str) -> Session:
        session = self.sessions.pop(session_id)
        forget = getattr(self.engine, "forget", None)
        if forget is not None:
            forget(session_id)
        return session

    # ------------------------------------------------------------------------------ endpoints

    async def chat(self, request: web.Request) -> web.StreamResponse:
        sid = request.match_info.get("sid") or request.headers.get("x-session-id")
        try:
            body = await request.json()
            routing_headers(sid, session=True)
        except MissingRoutingKey as e:
            return _error(400, "missing_session", f"{e}; post to /sessions/<id>/v1/chat/completions")
        except json.JSONDecodeError:
            return _error(400, "invalid_json", "the body is not JSON")
        session = self.sessions.get(sid or "")
        if session is None:
            return _error(404, "unknown_session", f"no open session {sid!r}")
        async with session.lock:
            try:
                choice, out = await self.turn(session, body)
            except HistoryMismatch as e:
                session.error = f"history mismatch: {e}"
                return _error(409, "history_mismatch", str(e))
            except ContextExceeded as e:
                return _error(400, "context_length_exceeded", str(e))
            except TemplateError as e:
                return _error(400, "template_error", str(e))
            except RequestError as e:  # the engine refused the request (too long for its context, ...)
                session.last_finish = "length"
                return _error(400, "invalid_request", str(e))
            except NoriaError as e:  # the engine failed, or (HTTP 4xx) refused the request
                if _refused(e):
                    session.last_finish = "length"
                    return _error(400, "invalid_request", str(e))
                session.engine_failure = e
                return _error(502, "engine_failure", str(e))
        response = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "noria-session",
            "choices": [choice],
            "usage": {
                "prompt_tokens": out.prompt_tokens,
                "completion_tokens": len(out.output_ids),
                "total_tokens": out.prompt_tokens + len(out.output_ids),  # required by OpenAI's schema
            },
            "noria": {"weight_version": out.weight_version, "cached_tokens": out.cached_tokens, "turn": session.turns},
        }
        if body.get("stream"):
            return await _one_chunk_stream(request, response)
        return web.json_response(response)

    async def turn(self, session: Session, body: dict[str, Any]) -> tuple[dict[str, Any], GenerateOutput]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise TemplateError("messages must be a non-empty list")
        kwargs = dict(body.get("chat_template_kwargs") or {})
        ids = session.input_ids(messages, body.get("tools"), kwargs)
        sampling = session.request_sampling(body)
        req = GenerateRequest(list(ids), sampling, routing_key=session.id, return_routed_experts=self.routes)
        out = await session_generate(self.engine, req)
        return session.record(out), out

    async def show(self, request: web.Request) -> web.Response:
        s = self.sessions.get(request.match_info["sid"])
        if s is None:
            return _error(404, "unknown_session", "no such session")
        return web.json_response({"id": s.id, "turns": s.turns, "tokens": len(s.ids), "policy_tokens": sum(s.loss_mask)})


def _refused(error: BaseException) -> bool:
    """Whether an engine client's error is the server's 4xx answer (a bad request, not a dead engine)."""
    cause = error.__cause__
    response = getattr(cause, "response", None)
    return response is not None and 400 <= getattr(response, "status_code", 0) < 500


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message, "type": "invalid_request_error"}}, status=status)


async def _one_chunk_stream(request: web.Request, response: dict[str, Any]) -> web.StreamResponse:
    choice = response["choices"][0]
    chunk = {
        **{k: v for k, v in response.items() if k != "choices"},
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": choice["message"], "finish_reason": choice["finish_reason"]}],
    }
    stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await stream.prepare(request)
    await stream.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await stream.write(b"data: [DONE]\n\n")
    await stream.write_eof()
    return stream


def session_status(session: Session) -> tuple[Status, str]:
    """How the recorded trajectory ended, from the session's side."""
    if session.error:
        return Status.FAILED, session.error
    if session.last_finish == "length":
        return Status.TRUNCATED, ""
    if session.turns == 0:
        return Status.FAILED, "the agent never called the model"
    return Status.COMPLETED, ""
