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

Bounds (``SessionLimits``, from ``rollout.session_max_open``, ``session_max_tokens`` and
``session_idle_timeout_s``; counted in ``SessionCounters``, one per run, shared by the run's
servers and logged as ``session/*`` metrics). Each answer is an OpenAI error body whose ``param``
names the option and ``limit`` its value:

- open sessions: a session takes a place at its first request and holds it until it is closed; a
  first request while ``max_open`` places are taken is answered 429 (``too_many_sessions``, with
  ``Retry-After``: OpenAI clients retry it). A session never let in ends FAILED, naming the cap.
- tokens per session: a request whose history would leave no room under ``max_tokens`` for one
  generated token is answered 413 (``session_tokens_exceeded``) and changes nothing in the record;
  generation is cut to the room left. The trajectory ends TRUNCATED (FAILED if it has no turn).
- idle sessions: a session with no request in flight for ``idle_timeout_s`` is closed (its place is
  freed); its later requests are answered 410 (``session_closed``). It ends TRUNCATED (FAILED if it
  has no turn), naming the timeout.

Bodies are checked before anything is recorded or sent: a body that is not a JSON object, or a
field of the wrong type, is answered 400 naming the field.

Not guaranteed: a session is one linear conversation (no branching, ``n`` = 1); requests of one
session are serialized; whoever is given a session's URL (the agent function) can use it.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from aiohttp import web

from noria.agent.chat_format import ChatFormat, TemplateError
from noria.agent.session_images import message_images
from noria.agent.session_bounds import (
    BadRequest, SessionCounters, SessionLimits, check_body, error_response, read_body, refuse_deflate,
)  # fmt: skip
from noria.data.vision_chat import image_data
from noria.engine.protocol import GenerateOutput, GenerateRequest, RequestError, SamplingParams
from noria.errors import NoriaError
from noria.router.client import MissingRoutingKey, routing_headers
from noria.types import Sample, Status

OnMismatch = Literal["error", "rerender"]


class HistoryMismatch(NoriaError):
    """The client's re-sent history differs from what the session recorded."""


class ContextExceeded(NoriaError):
    """The session's tokens would exceed its token cap (``SessionLimits.max_tokens``)."""


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
    images: list[str] = field(default_factory=list)
    """The record's images in the order of their tokens (a vision-language policy; ``noria.agent.session_images``)."""
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
    admitted: bool = False
    """Whether it holds a place (``SessionLimits.max_open``); given back once when it is closed."""
    released: bool = False
    pending: int = 0
    """Requests of it in the server now (waiting for its lock or running)."""
    last_active: float = 0.0
    refusals: int = 0
    """Its first requests answered 429 (no place free)."""
    capped: str = ""
    """Why a request was answered 413 (its token cap), if one was."""
    closed: str = ""
    """Why the server closed it (idle), if it did; its later requests are answered 410."""

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def input_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None, kwargs: dict[str, Any]) -> list[int]:
        """The ids to send for this request; appends the non-policy tokens to the record. A request
        past the token cap (``ContextExceeded``) or with a mismatched history changes nothing."""
        known = len(self.messages)
        if self.prompt_ids and (len(messages) <= known or not same_history(messages[:known], self.messages)):
            if self.on_mismatch == "error":
                raise HistoryMismatch(history_diff(messages, self.messages))
            refs = message_images(messages)
            first = self.fmt.first_ids(messages, tools, images=refs, **kwargs)
            self.check_room(len(first))
            self.rerenders += 1
            self.dropped_policy_tokens += sum(self.loss_mask)
            self.response_ids, self.loss_mask, self.logprobs, self.versions, self.routes = [], [], [], [], []
            self.prompt_ids, self.messages, self.images = first, [dict(m) for m in messages], refs
            return self.ids
        if not self.prompt_ids:
            refs = message_images(messages)
            first = self.fmt.first_ids(messages, tools, images=refs, **kwargs)
            self.check_room(len(first))
            self.prompt_ids, self.messages, self.images = first, [dict(m) for m in messages], refs
            return self.ids
        appended = messages[known:]
        refs = message_images(appended)
        ids = self.fmt.appended_ids(appended, tools, images=refs, **kwargs)
        if not self.response_ids or self.response_ids[-1] != self.fmt.end_of_turn_id:
            ids = [self.fmt.end_of_turn_id, *ids]  # the last turn stopped without closing (length or stop string)
        self.check_room(len(self.ids) + len(ids))
        self.append(ids)
        self.messages.extend(dict(m) for m in appended)
        self.images += refs
        return self.ids

    def check_room(self, tokens: int) -> None:
        """``ContextExceeded`` unless a record of ``tokens`` leaves room for one generated token."""
        if self.max_total_tokens is not None and tokens >= self.max_total_tokens:
            raise ContextExceeded(
                f"session {self.id} would hold {tokens} tokens before generating; rollout.session_max_tokens is {self.max_total_tokens}"
            )

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
        sample.images = list(self.images) or None
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
        """The server's sampling with the request's ``max_tokens`` (at most the server's, and the room
        under the token cap) and ``stop`` strings added (``check_body`` checked their types)."""
        cap = self.sampling.max_new_tokens
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or cap
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        new = min(int(asked), cap)
        if self.max_total_tokens is not None:
            self.check_room(len(self.ids))
            new = min(new, self.max_total_tokens - len(self.ids))
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
        limits: SessionLimits | None = None,
        counters: SessionCounters | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        routes: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if on_mismatch not in ("error", "rerender"):
            raise ValueError(f"on_mismatch must be 'error' or 'rerender', got {on_mismatch!r}")
        self.engine = engine
        self.fmt = ChatFormat(tokenizer)
        self.sampling = sampling
        self.on_mismatch: OnMismatch = on_mismatch
        self.limits = limits or SessionLimits()
        self.counters = counters if counters is not None else SessionCounters()
        """Shared by every server of a run (``run_rollout`` keeps one per rollout context)."""
        self.clock = clock
        """Seconds, for the idle timeout (a test passes its own clock)."""
        self.routes = routes
        """Ask the engine for each policy token's MoE route (``rollout.routing_replay`` / ``record_routes``)."""
        self.host, self.port = host, port
        self.sessions: dict[str, Session] = {}
        self.runner: web.AppRunner | None = None
        self.reaper: asyncio.Task | None = None
        self.secret = secrets.token_urlsafe(24)
        """The first path segment of every URL this server answers (see the module docstring)."""

    # ------------------------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        """The aiohttp application: every route this server answers (the fuzzer reads them here)."""
        app = web.Application(middlewares=[refuse_deflate])
        root = f"/{self.secret}"
        app.router.add_post(root + "/sessions/{sid}/v1/chat/completions", self.chat)
        app.router.add_post(root + "/v1/chat/completions", self.chat)
        app.router.add_get(root + "/sessions/{sid}", self.show)
        return app

    async def start(self) -> SessionServer:
        self.runner = web.AppRunner(self.app(), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        if self.limits.idle_timeout_s is not None:
            self.reaper = asyncio.create_task(self._reap(self.limits.idle_timeout_s), name="session-idle-reaper")
        return self

    async def stop(self) -> None:
        if self.reaper is not None:
            self.reaper.cancel()
            await asyncio.gather(self.reaper, return_exceptions=True)
            self.reaper = None
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
        session = Session(sid, self.fmt, sampling, self.on_mismatch, self.limits.max_tokens, last_active=self.clock())
        self.sessions[sid] = session
        return session

    def base_url(self, session_id: str) -> str:
        return f"{self.url}/sessions/{session_id}/v1"

    def close(self, session_id: str) -> Session:
        session = self.sessions.pop(session_id)
        self._release(session)
        forget = getattr(self.engine, "forget", None)
        if forget is not None:
            forget(session_id)
        return session

    # ------------------------------------------------------------------------------ bounds

    def _admit(self, session: Session) -> bool:
        """Give ``session`` a place if it has none and one is free (``SessionLimits.max_open``)."""
        if session.admitted:
            return True
        cap = self.limits.max_open
        if cap is not None and self.counters.open >= cap:
            session.refusals += 1
            self.counters.refused_open += 1
            return False
        session.admitted = True
        self.counters.open += 1
        self.counters.admitted += 1
        return True

    def _release(self, session: Session) -> None:
        if session.admitted and not session.released:
            session.released = True
            self.counters.open -= 1

    def close_idle(self) -> list[str]:
        """Close every session idle for ``idle_timeout_s`` (nothing in flight); their ids."""
        timeout = self.limits.idle_timeout_s
        if timeout is None:
            return []
        now, closed = self.clock(), []
        for session in self.sessions.values():
            if not session.closed and session.pending == 0 and now - session.last_active >= timeout:
                session.closed = f"closed after {now - session.last_active:.1f} s idle; rollout.session_idle_timeout_s is {timeout:g}"
                self._release(session)
                self.counters.closed_idle += 1
                closed.append(session.id)
        return closed

    async def _reap(self, timeout: float) -> None:
        while True:
            await asyncio.sleep(min(max(timeout / 4, 0.05), 5.0))
            self.close_idle()

    # ------------------------------------------------------------------------------ endpoints

    async def chat(self, request: web.Request) -> web.StreamResponse:
        sid = request.match_info.get("sid") or request.headers.get("x-session-id")
        try:
            body = check_body(await read_body(request))
            routing_headers(sid, session=True)
        except MissingRoutingKey as e:
            return error_response(400, "missing_session", f"{e}; post to /sessions/<id>/v1/chat/completions")
        except BadRequest as e:
            return error_response(400, "invalid_request", str(e))
        session = self.sessions.get(sid or "")
        if session is None:
            return error_response(404, "unknown_session", f"no open session {sid!r}")
        self.close_idle()
        refused = self._refusal(session)
        if refused is not None:
            if not session.closed:  # a client retrying a 429 is not idle
                session.last_active = self.clock()
            return refused
        session.pending += 1
        try:
            answer = await self._turn_locked(session, body)
        finally:
            session.pending -= 1
            session.last_active = self.clock()
        if isinstance(answer, web.Response):
            return answer
        if body.get("stream"):
            return await _one_chunk_stream(request, answer)
        return web.json_response(answer)

    def _refusal(self, session: Session) -> web.Response | None:
        """The 410 of a closed session or the 429 of one without a place; None if it may go on."""
        if session.closed:
            return error_response(410, "session_closed", f"session {session.id} was {session.closed}", "rollout.session_idle_timeout_s",
                          self.limits.idle_timeout_s)  # fmt: skip
        if not self._admit(session):
            cap = self.limits.max_open
            message = f"{self.counters.open} sessions are open; rollout.session_max_open is {cap}: retry when one closes"
            response = error_response(429, "too_many_sessions", message, "rollout.session_max_open", cap, kind="rate_limit_error")
            response.headers["Retry-After"] = "1"
            return response
        return None

    async def _turn_locked(self, session: Session, body: dict[str, Any]) -> dict[str, Any] | web.Response:
        """One turn under the session's lock: the OpenAI response, or the error answer."""
        async with session.lock:
            session.last_active = self.clock()
            try:
                choice, out = await self.turn(session, body)
            except HistoryMismatch as e:
                session.error = f"history mismatch: {e}"
                return error_response(409, "history_mismatch", str(e))
            except ContextExceeded as e:
                session.capped, session.last_finish = str(e), "length"
                self.counters.refused_tokens += 1
                return error_response(413, "session_tokens_exceeded", str(e), "rollout.session_max_tokens", self.limits.max_tokens)
            except (TemplateError, BadRequest) as e:
                return error_response(400, "template_error" if isinstance(e, TemplateError) else "invalid_request", str(e))
            except RequestError as e:  # the engine refused the request (too long for its context, ...)
                session.last_finish = "length"
                return error_response(400, "invalid_request", str(e))
            except NoriaError as e:  # the engine failed, or (HTTP 4xx) refused the request
                if _refused(e):
                    session.last_finish = "length"
                    return error_response(400, "invalid_request", str(e))
                session.engine_failure = e
                return error_response(502, "engine_failure", str(e))
        return {
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

    async def turn(self, session: Session, body: dict[str, Any]) -> tuple[dict[str, Any], GenerateOutput]:
        kwargs = dict(body.get("chat_template_kwargs") or {})
        ids = session.input_ids(body["messages"], body.get("tools"), kwargs)
        sampling = session.request_sampling(body)
        req = GenerateRequest(list(ids), sampling, routing_key=session.id, return_routed_experts=self.routes,
                              image_data=image_data(session.images) if session.images else [])
        out = await session_generate(self.engine, req)
        return session.record(out), out

    async def show(self, request: web.Request) -> web.Response:
        s = self.sessions.get(request.match_info["sid"])
        if s is None:
            return error_response(404, "unknown_session", "no such session")
        return web.json_response({"id": s.id, "turns": s.turns, "tokens": len(s.ids), "policy_tokens": sum(s.loss_mask)})


def _refused(error: BaseException) -> bool:
    """Whether an engine client's error is the server's 4xx answer (a bad request, not a dead engine)."""
    cause = error.__cause__
    response = getattr(cause, "response", None)
    return response is not None and 400 <= getattr(response, "status_code", 0) < 500


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
    """How the recorded trajectory ended, from the session's side: a bound that stopped it is named
    (TRUNCATED, or FAILED when it holds no turn)."""
    if session.error:
        return Status.FAILED, session.error
    bound = session.capped or (f"session {session.id} was {session.closed}" if session.closed else "")
    if bound:
        return (Status.TRUNCATED if session.turns else Status.FAILED), bound
    if session.last_finish == "length":
        return Status.TRUNCATED, ""
    if session.turns == 0 and session.refusals:
        return Status.FAILED, f"refused {session.refusals} time(s): too many open sessions (rollout.session_max_open)"
    if session.turns == 0:
        return Status.FAILED, "the agent never called the model"
    return Status.COMPLETED, ""
