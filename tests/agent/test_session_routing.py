"""Sessions through the real sglang-router (marked ``router``): each session stays on one engine, so
every later turn hits that engine's prefix cache; a keyless session request never leaves Noria
(CPU, loopback only)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from engine_server_util import routed_engines

from noria.agent.session import SessionServer, session_generate
from noria.engine.protocol import GenerateRequest, SamplingParams
from noria.router import MissingRoutingKey


@pytest.fixture(scope="module")
def routed(tiny_model_dir, tmp_path_factory):
    pytest.importorskip("sglang_router")
    yield from routed_engines(tiny_model_dir, tmp_path_factory.mktemp("session-router-logs"))


@pytest.mark.router
def test_sessions_stick_to_one_engine_and_hit_its_cache(routed, tiny_model_dir):
    from noria.models import load_tokenizer
    from noria.rollout import HttpEngineClient

    router, _ = routed
    tok = load_tokenizer(tiny_model_dir)

    async def run():
        client = HttpEngineClient(router.url)
        sampling = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        async with SessionServer(client, tok, sampling) as server, httpx.AsyncClient(timeout=60) as http:

            async def one(i):
                sid = f"route-{i}"
                server.open(sid)
                messages = [{"role": "user", "content": f"What is {i} + 3?"}]
                cached = []
                for t in range(4):
                    r = await http.post(f"{server.base_url(sid)}/chat/completions", json={"messages": messages})
                    assert r.status_code == 200, r.text
                    data = r.json()
                    cached.append((data["noria"]["cached_tokens"], data["usage"]["prompt_tokens"]))
                    messages += [data["choices"][0]["message"], {"role": "user", "content": f"And {t}?"}]
                server.close(sid)
                return cached

            out = await asyncio.gather(*(one(i) for i in range(4)))
            with pytest.raises(MissingRoutingKey):  # refused by Noria; nothing reaches the router
                await session_generate(client, GenerateRequest([5, 6], sampling))
            await client.aclose()
            return out

    block = 16  # the engine caches whole KV blocks
    for turns in asyncio.run(run()):
        for (_, before), (cached, _) in zip(turns, turns[1:]):
            # every later turn finds the previous turn's prompt and output (all but the last sampled
            # token, whose KV was never computed) in the cache of the engine it went to
            assert cached >= (before + 4 - 1) // block * block > 0, turns
