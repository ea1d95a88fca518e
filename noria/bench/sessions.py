"""Multi-turn sessions over two engines behind the real sglang-router: session vs load-based routing.

``python -m noria.bench.sessions --model smollm2-135m-instruct [--sessions 8 --turns 4 --json PATH]``

The workload. ``sessions`` conversations run at once, each ``turns`` turns long, through the
session server (token-in-token-out, ``noria.agent.session``) to two ``noria serve`` engines behind
one ``sglang-router`` process. Every session starts with the same system prompt (the tool
instructions an agent would carry) and its own question; each later turn appends a short user
message. Generation is greedy with ``ignore_eos`` for exactly ``new_tokens`` tokens, so both cases
see the same token counts. A session sends its next turn as soon as the previous one returns.

Cases, each on the same two engines, their prefix caches flushed first and then warmed with the
shared system prompt (one request sent to each engine directly: a fleet serving agents holds it):

- ``noria`` (session routing): the router runs ``--policy manual --assignment-mode min_load`` and
  each request carries its session id in ``x-smg-routing-key``;
- ``load_routing``: a second router with ``--policy power_of_two`` (the less loaded engine for each
  request), and the session server sends no key.

Measured per case: hit rate = sum of the engines' ``cached_tokens`` over sum of prompt tokens of
every request (also for turns >= 2 only), generated tokens per second of wall time, wall seconds,
and the busiest engine's share of the generated tokens (0.5 is an even split).

Not measured: eviction under memory pressure (the caches hold every session), think time between
turns. Both engines and the router share this machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

from noria.engine.protocol import GenerateOutput, GenerateRequest, SamplingParams
from noria.process import Child

SYSTEM = (
    "You are a careful assistant working in a multi-step session. Tools are available to you: a calculator "
    "for arithmetic, a Python sandbox for code, and a search index over the project documentation. Think about "
    "which tool helps, call it, read its answer, and keep each reply short and precise. "
) * 3


class KeylessClient:
    """The load-based peer: forwards a session's requests WITHOUT their routing key."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        return await self.client.generate(replace(req, routing_key=None))


def start_engine(model: str, log_dir: Path, name: str) -> tuple[Child, str]:
    from noria.net import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "noria", "serve", "--model", model, "--port", str(port), "--engine-id", name]
    cmd += ["--engine.kv_cache_tokens", "65536"]
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    url = f"http://127.0.0.1:{port}"
    child = Child.start(cmd, name=f"engine {name} at {url}", log_path=log_dir / f"{name}.log", env=env)
    child.wait_http(f"{url}/health", timeout_s=300)
    return child, url


async def run_case(engine: Any, tokenizer: Any, sessions: int, turns: int, new_tokens: int) -> dict[str, float]:
    from noria.agent.session import SessionServer

    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    import httpx

    async with SessionServer(engine, tokenizer, sampling) as server, httpx.AsyncClient(timeout=600) as http:

        async def one(i: int) -> Any:
            sid = f"bench-{id(server):x}-{i}"
            server.open(sid)
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}: what is {i} * 17?"}]
            per_turn = []
            for t in range(turns):
                r = await http.post(f"{server.base_url(sid)}/chat/completions", json={"messages": messages})
                r.raise_for_status()
                data = r.json()
                per_turn.append((data["usage"]["prompt_tokens"], data["noria"]["cached_tokens"]))
                messages += [data["choices"][0]["message"], {"role": "user", "content": f"Turn {t + 2}: go on."}]
            server.close(sid)
            return per_turn

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(sessions)))
        seconds = time.perf_counter() - start
    prompt = sum(p for r in results for p, _ in r)
    cached = sum(c for r in results for _, c in r)
    later_p = sum(p for r in results for p, _ in r[1:])
    later_c = sum(c for r in results for _, c in r[1:])
    return {
        "hit_rate": cached / prompt,
        "hit_rate_turn2plus": later_c / max(later_p, 1),
        "tokens_per_s": sessions * turns * new_tokens / seconds,
        "seconds": seconds,
    }


def generated_tokens(urls: list[str]) -> list[float]:
    """Each engine's generated-token counter (its Prometheus ``/metrics``)."""
    out = []
    for u in urls:
        text = urllib.request.urlopen(f"{u}/metrics", timeout=30).read().decode()
        line = next(x for x in text.splitlines() if x.startswith("noria_engine_generated_tokens "))
        out.append(float(line.split()[1]))
    return out


def flush_and_warm(urls: list[str], tokenizer: Any) -> None:
    """Empty every engine's prefix cache, then prefill the shared system prompt on each (steady state)."""
    from noria.agent.chat_format import ChatFormat

    ids = ChatFormat(tokenizer).first_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "warm-up"}])
    body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode()
    for u in urls:
        urllib.request.urlopen(urllib.request.Request(f"{u}/flush_cache", data=b"{}", method="POST"), timeout=30).read()
        request = urllib.request.Request(f"{u}/generate", data=body, method="POST", headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=900).read()  # a first request may build the C++ kernels


def main(argv: list[str] | None = None) -> int:
    from noria.bench import print_table, work_folder, write_json
    from noria.models import load_tokenizer
    from noria.models.catalog import model_path
    from noria.rollout import HttpEngineClient
    from noria.router.sglang_router import SglangRouter

    p = argparse.ArgumentParser(prog="python -m noria.bench.sessions", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--json")
    args = p.parse_args(argv)
    folder = str(model_path(args.model))
    tokenizer = load_tokenizer(folder)
    logs = work_folder(None, "noria-bench-sessions-")
    engines: list[tuple[Child, str]] = []
    figures = {}
    try:
        for i in range(2):
            engines.append(start_engine(folder, logs, f"engine-{i}"))
        urls = [u for _, u in engines]
        for case, policy in (("noria", "manual"), ("load_routing", "power_of_two")):
            flush_and_warm(urls, tokenizer)
            with SglangRouter(urls, policy=policy, log_path=logs / f"router-{case}.log") as router:
                client = HttpEngineClient(router.url)
                engine = client if case == "noria" else KeylessClient(client)
                before = generated_tokens(urls)
                figures[case] = asyncio.run(run_case(engine, tokenizer, args.sessions, args.turns, args.new_tokens))
                work = [a - b for a, b in zip(generated_tokens(urls), before)]
                figures[case]["busiest_engine_share"] = max(work) / max(sum(work), 1.0)
    finally:
        for child, _ in engines:
            child.stop()
    name = f"{args.model} engines=2 sessions={args.sessions} turns={args.turns} new={args.new_tokens}"
    results = [
        {"case": name, "metric": metric, "noria": figures["noria"][metric], "peers": {"load_routing": figures["load_routing"][metric]}}
        for metric in ("hit_rate", "hit_rate_turn2plus", "tokens_per_s", "seconds", "busiest_engine_share")
    ]
    rows = [[r["metric"], r["noria"], r["peers"]["load_routing"]] for r in results]
    print_table(f"sessions: {name}", ["metric", "noria (session key)", "load_routing"], rows)
    if args.json:
        write_json(args.json, "sessions", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
