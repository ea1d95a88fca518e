"""Routing: two ``noria serve`` engines behind the real sglang-router (marked ``router``), the Noria
client's refusal of keyless session requests, and the in-process router's same semantics (CPU,
loopback only)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from engine_server_util import routed_engines

from noria.engine.protocol import GenerateOutput, GenerateRequest, SamplingParams
from noria.router import ROUTING_HEADER, LocalRouter, MissingRoutingKey, RoutedClient
from noria.net import free_port

LONG = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}
ONE = {"max_new_tokens": 1}


@pytest.fixture(scope="module")
def routed(tiny_model_dir, tmp_path_factory):
    pytest.importorskip("sglang_router")
    yield from routed_engines(tiny_model_dir, tmp_path_factory.mktemp("router-logs"))


def engine_of(router_url: str, key: str | None, sampling: dict = ONE) -> str:
    headers = {ROUTING_HEADER: key} if key else {}
    r = httpx.post(f"{router_url}/generate", json={"input_ids": [5, 6], "sampling_params": sampling}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["engine_id"]


@pytest.mark.router
def test_router_registers_both_engines(routed):
    router, engines = routed
    workers = router.workers()
    assert {w["url"] for w in workers} == {e.url for e in engines}
    assert all(w["is_healthy"] for w in workers)


@pytest.mark.router
def test_same_key_reaches_the_same_engine(routed):
    router, _ = routed
    seen = {}
    for key in ("alpha", "beta", "gamma", "delta", "epsilon", "zeta"):
        engines = {engine_of(router.url, key) for _ in range(4)}
        assert len(engines) == 1, (key, engines)
        seen[key] = engines.pop()
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for key, engine in list(seen.items())[:2]:  # OpenAI traffic follows the same key
        r = httpx.post(f"{router.url}/v1/chat/completions", json=chat, headers={ROUTING_HEADER: key}, timeout=60)
        assert r.status_code == 200 and r.json()["engine_id"] == engine


@pytest.mark.router
def test_new_key_goes_to_the_less_loaded_engine(routed):
    router, engines = routed
    busy = engine_of(router.url, "busy-session")
    busy_url = engines[int(busy.rsplit("-", 1)[1])].url  # engine ids are engine-0, engine-1
    # Hold the busy engine's requests (paused in place) so the router sees 3 in flight there.
    assert httpx.post(f"{busy_url}/pause_generation", json={"mode": "in_place"}).status_code == 200
    try:
        with ThreadPoolExecutor(3) as pool:
            held = [pool.submit(engine_of, router.url, "busy-session", LONG) for _ in range(3)]
            deadline = time.monotonic() + 10
            while max(w["load"] for w in router.workers()) < 3:  # the router counts its own in-flight requests
                assert time.monotonic() < deadline, router.workers()
                time.sleep(0.01)
            new = [engine_of(router.url, f"fresh-{i}") for i in range(4)]
            httpx.post(f"{busy_url}/continue_generation")
            assert all(e == busy for e in (f.result(timeout=60) for f in held))
    finally:
        httpx.post(f"{busy_url}/continue_generation")
    assert busy not in new, (busy, new)


@pytest.mark.router
def test_routed_client_through_the_router(routed):
    router, _ = routed

    async def run():
        async with RoutedClient(router.url) as client:
            session = client.session("client-session")
            engines = {(await session.generate({"input_ids": [5], "sampling_params": ONE}))["meta_info"]["engine_id"] for _ in range(3)}
            single = await client.generate({"input_ids": [5], "sampling_params": ONE})  # single turn: no key needed
            with pytest.raises(MissingRoutingKey):
                await client.generate({"input_ids": [5]}, session=True)
            return engines, single

    engines, single = asyncio.run(run())
    assert len(engines) == 1 and single["output_ids"]


# ------------------------------------------------------------------------------------ no router needed


def test_client_refuses_keyless_session_before_sending():
    sent = []

    async def run():
        # Every request that is sent is recorded by the mock transport.
        transport = httpx.MockTransport(lambda request: sent.append(request) or httpx.Response(200, json={}))
        client = RoutedClient(f"http://127.0.0.1:{free_port()}", transport=transport)
        with pytest.raises(MissingRoutingKey):
            await client.generate({"input_ids": [5]}, session=True)
        with pytest.raises(MissingRoutingKey):
            await client.chat({"messages": []}, routing_key="", session=True)
        with pytest.raises(MissingRoutingKey):
            client.session("")
        await client.generate({"input_ids": [5]}, routing_key="k", session=True)
        await client.generate({"input_ids": [5]})
        await client.aclose()

    asyncio.run(run())
    assert [r.headers.get(ROUTING_HEADER) for r in sent] == ["k", None]


class _FakeEngine:
    """Holds each request until released, so load is observable."""

    def __init__(self, name: str) -> None:
        self.name, self.release = name, asyncio.Event()

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        if req.sampling.max_new_tokens > 1:
            await self.release.wait()
        return GenerateOutput(req.rid, [1], [0.0], [0], text=self.name, finish_reason={"type": "length"})


def test_local_router_has_the_same_semantics():
    async def run():
        engines = [_FakeEngine("a"), _FakeEngine("b")]
        router = LocalRouter(engines)

        async def route(key, long=False, session=True):
            req = GenerateRequest([5], SamplingParams(max_new_tokens=5 if long else 1), routing_key=key)
            return (await router.generate(req, session=session)).text

        with pytest.raises(MissingRoutingKey):
            await route(None)
        first = await route("s1")
        assert [await route("s1") for _ in range(3)] == [first] * 3
        busy = asyncio.gather(*(route("s1", long=True) for _ in range(2)))
        await asyncio.sleep(0)
        assert router.inflight[router.assignment["s1"]] == 2
        fresh = {await route(f"n{i}") for i in range(3)}
        assert fresh == {"b" if first == "a" else "a"}
        assert await route(None, session=False) != first  # keyless single turn: least loaded
        for e in engines:
            e.release.set()
        assert await busy == [first, first]

        one = LocalRouter([engines[0]])  # one engine: everything goes to it, the key rule still holds
        with pytest.raises(MissingRoutingKey):
            await one.generate(GenerateRequest([5]), session=True)
        assert one.pick("x", session=True) == 0 and one.pick(None) == 0

    asyncio.run(run())


@pytest.mark.router
def test_a_key_that_starts_with_a_dash_reaches_the_router_whole():
    """``secrets.token_urlsafe`` starts with ``-`` about once in 64 keys; the router's argument
    parser must take it as the key's value, not as an option of its own."""
    import os
    import subprocess
    import sys

    from noria.router.sglang_router import ROUTER_WITH_KEY

    pytest.importorskip("sglang_router")
    env = {**os.environ, "NORIA_ROUTER_KEY": "-Zq3_key"}
    done = subprocess.run([sys.executable, "-c", ROUTER_WITH_KEY, "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-400:]
