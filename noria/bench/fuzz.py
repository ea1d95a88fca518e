"""``noria bench fuzz``: every HTTP route of ``noria serve``, the session server and the router front,
fuzzed from Hypothesis strategies (``noria.bench.fuzz_strategies``), with concurrency.

The rig (``start_rig``), all on 127.0.0.1 and started through ``noria.process``: one ``noria serve``
engine; the real sglang-router in front of it; a session server in a process of its own
(``python -m noria.bench.fuzz serve-sessions``, over the engine, with a pool of open sessions it
refreshes and small bounds, so that 429, 413 and 410 answers happen).

The route tables are read from the servers themselves: ``EngineServer.app()`` and
``SessionServer.app()`` (aiohttp routers); the router's forwarded routes are
``fuzz_strategies.ROUTER_PATHS``. A route without a spec is an error before anything is sent
(``uncovered``).

A run (``fuzz_target``): Hypothesis draws ``requests`` shots (seeded: the same seed, the same
requests), sent ``batch`` at a time, concurrently, over httpx. After each batch the engine is
restored (a fuzzed pause or memory release undone: ``/resume_memory_occupation``,
``/continue_generation``), then checked: the process is alive, ``/health_generate`` answers 200
(the session server: a first turn on a fresh session answers 200, or its documented 429 or 410), and its
resident memory (``VmRSS`` of ``/proc/PID/status``) is sampled.

Pass: no 5xx but the documented ones (``DOCUMENTED_5XX``), no request without an answer (except a
body past the limit, which the server may cut off after its 413), no failed health check, and RSS
growth after the warm-up (the first tenth of the batches) within the target's slack. Each distinct
failure is reported once with an example; ``FIXED`` lists those this fuzzer found and the test that
now pins each.

Not covered: raw HTTP framing (httpx writes well-formed requests), slow-loris clients, the router's
admin routes (``/workers``: adding and removing engines is the launcher's business).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gzip
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DOCUMENTED_5XX: dict[tuple[str, str, int], str] = {
    ("session", "/{secret}/sessions/{sid}/v1/chat/completions", 502): "the engine behind the session failed (not a refusal): the session "
    "server answers 502 engine_failure and the rollout re-raises it; the rig's engine is fuzzed by no one meanwhile, so none is expected",
}  # fmt: skip
"""(target, route, status) -> why that 5xx is the right answer. Anything else is a failure."""

FIXED: list[tuple[str, str]] = [
    ("session server: a body that is not a JSON object, not UTF-8, nested thousands deep, with a bogus Content-Encoding, "
     "a field of the wrong type (messages, max_tokens, stop, chat_template_kwargs, tool_calls, content) or a lone "
     "surrogate was answered 500", "tests/agent/test_session_server.py::test_fuzz_regression_malformed_chat_bodies_are_400_naming_the_field_never_500"),
    ("noria serve: a bogus Content-Encoding, JSON nested thousands deep, a lone surrogate in text, prompt or messages, "
     "non-string names of /weights_checksum, a weight group of world size 0 or over nccl on a CPU engine were answered 500",
     "tests/engine/test_fuzz.py::test_fuzz_regression_engine_answers_400_naming_the_problem_never_500"),
    ("noria serve: rank_offset 0 made the engine host a weight group of the client's choosing (its store listening on the "
     "client's port; the group kept for good)", "tests/engine/test_fuzz.py::test_fuzz_regression_the_engine_never_hosts_a_weight_group_a_client_asks_for"),
    ("noria serve: a streamed /generate whose rid was in flight was answered 200, then cut off",
     "tests/engine/test_fuzz.py::test_fuzz_regression_a_streamed_request_with_an_id_in_flight_is_400_not_a_cut_stream"),
    ("router front: ten refused streamed requests of one client opened sglang-router's circuit breaker: 503 to everyone "
     "for a minute", "tests/engine/test_fuzz.py::test_fuzz_regression_refused_streamed_requests_do_not_take_the_engine_out_of_the_router"),
    ("noria serve: a streamed request the engine refused once admitted (logprob_start_len past the prompt) got a 400 written "
     "into its open stream: an illegal chunk, a cut stream through the router",
     "tests/engine/test_fuzz.py::test_fuzz_regression_an_error_after_a_stream_started_is_its_last_event_not_a_broken_stream"),
    ("noria serve: /update_weights_from_disk with a path the system refuses (too long) was answered 500",
     "tests/engine/test_fuzz.py::test_fuzz_regression_engine_answers_400_naming_the_problem_never_500"),
    ("noria serve: /abort_request abort_all aborted /health_generate's own generation, which answered 503",
     "tests/engine/test_fuzz.py::test_fuzz_regression_abort_all_leaves_the_health_probe_alone"),
    ("noria serve: a sampling integer past 2^63 (top_k or stop_token_ids) passed the checks and killed the engine loop; "
     "every later request was a 500", "tests/engine/test_fuzz.py::test_fuzz_regression_integers_past_64_bits_are_400_and_the_engine_lives"),
]  # fmt: skip
"""Failures this fuzzer found, each fixed, and the regression test that pins it."""

SESSION_LIMITS = {"max_open": 3, "max_tokens": 160, "idle_timeout_s": 1.0}
"""The rig's session server bounds: small, so that 429, 413 and 410 answers happen under fuzzing."""
RSS_SLACK_MB = {"engine": 3 * 64 + 32, "session": 48, "router": 3 * 64 + 32}
"""Resident memory a target may grow by after the warm-up: three bodies at the body limit (a
64 MiB body read before its 413 is memory the allocator may keep) and some room."""


@dataclass
class Target:
    """One server under fuzzing: where it answers, its routes' specs, how to check it."""

    name: str
    url: str
    specs: list[Any]
    fill: dict[str, Any]
    limit: int
    pids: dict[str, int]
    """Processes whose RSS is sampled (name -> pid)."""
    engine_url: str
    probe: Any = None
    """async (client, batch index) -> error or None: the target's own health check past the engine's."""


@dataclass
class Report:
    """What one target's run saw."""

    target: str
    requests: int = 0
    seconds: float = 0.0
    statuses: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    failures: dict[str, dict[str, Any]] = field(default_factory=dict)
    health_failures: list[str] = field(default_factory=list)
    rss_mb: dict[str, list[float]] = field(default_factory=dict)
    heavy: int = 0

    def fail(self, key: str, shot: Any, note: str) -> None:
        entry = self.failures.setdefault(key, {"count": 0, "example": example(shot), "note": note[:300]})
        entry["count"] += 1

    def rss_growth(self) -> dict[str, float]:
        """Per process: MiB above the warm-up's peak (first tenth of the batches) reached afterwards."""
        out = {}
        for name, samples in self.rss_mb.items():
            warm = max(1, len(samples) // 10)
            out[name] = max(samples[warm:], default=samples[-1]) - max(samples[:warm]) if samples else 0.0
        return out

    def problems(self) -> list[str]:
        """Why this run did not pass (empty if it did)."""
        out = [f"{k} ({v['count']}x), e.g. {v['example']}: {v['note']}" for k, v in self.failures.items()]
        out += [f"health: {h}" for h in self.health_failures]
        out += [f"RSS of {name} grew {g:.0f} MiB after the warm-up (slack {RSS_SLACK_MB[self.target]} MiB)"
                for name, g in self.rss_growth().items() if g > RSS_SLACK_MB[self.target]]  # fmt: skip
        return out


def example(shot: Any) -> str:
    body = "<streamed>" if shot.stream else (shot.body or b"")[:200]
    return f"{shot.method} {shot.path[:120]} kind={shot.kind} headers={dict(shot.headers)} body={body!r}"


# ------------------------------------------------------------------------------------ route tables


def app_paths(app: Any, secret: str = "") -> set[str]:
    """The path patterns an aiohttp application answers (``secret`` written as ``{secret}``)."""
    paths = {route.resource.canonical for route in app.router.routes() if route.resource is not None}
    return {p.replace(secret, "{secret}") if secret else p for p in paths}


def engine_paths() -> set[str]:
    from noria.engine.server import EngineServer, ServerOptions

    return app_paths(EngineServer(lambda: None, ServerOptions(), "unloaded").app())


def session_paths(tokenizer: Any) -> set[str]:
    from noria.agent.session import SessionServer
    from noria.engine.protocol import SamplingParams

    server = SessionServer(None, tokenizer, SamplingParams())
    return app_paths(server.app(), server.secret)


def uncovered(paths: set[str], specs: list[Any]) -> list[str]:
    """Routes the server answers that no spec fuzzes (the run refuses to start with any)."""
    return sorted(paths - {s.path for s in specs})


def check_coverage(model: str) -> None:
    """Refuse to run while a route of ``noria serve`` or the session server has no spec."""
    from transformers import AutoTokenizer

    from noria.bench.fuzz_strategies import engine_specs, session_specs

    missing = uncovered(engine_paths(), engine_specs()) + uncovered(session_paths(AutoTokenizer.from_pretrained(model)), session_specs())
    if missing:
        raise SystemExit(f"noria bench fuzz: routes without a strategy in noria.bench.fuzz_strategies: {missing}")


# ------------------------------------------------------------------------------------ sending


async def oversize(n: int):
    chunk = b" " * (1 << 20)
    for _ in range(n // len(chunk) + 1):
        yield chunk


async def send(client: Any, base: str, shot: Any) -> tuple[int | None, str]:
    """(status, error message or exception) of one shot."""
    import httpx

    content = oversize(shot.stream) if shot.stream else shot.body
    try:
        r = await client.request(shot.method, base + shot.path, headers=dict(shot.headers), content=content)
    except httpx.HTTPError as e:
        return None, f"{type(e).__name__}: {e}"
    text = r.text
    try:
        text = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        pass
    return r.status_code, str(text)[:300]


def judge(report: Report, target: Target, shot: Any, status: int | None, note: str) -> None:
    """Count the answer; record a failure: no answer (but to a body past the limit), an undocumented 5xx."""
    report.requests += 1
    report.kinds[shot.kind] += 1
    report.statuses["none" if status is None else str(status)] += 1
    if status is None and not shot.stream and shot.kind != "bomb":
        report.fail(f"{target.name} {shot.route}: no answer ({note.split(':')[0]})", shot, note)
    elif status is not None and status >= 500 and (target.name, shot.route, status) not in DOCUMENTED_5XX:
        report.fail(f"{target.name} {shot.route}: HTTP {status} {re.sub(r'[0-9]+', 'N', note)[:60]}", shot, note)


def lighten(shot: Any, report: Report, heavy_every: int) -> Any:
    """A heavy shot (``fuzz_strategies.HEAVY``) past the quota becomes a small gzip one."""
    from noria.bench.fuzz_strategies import HEAVY

    if shot.kind not in HEAVY:
        return shot
    if report.heavy < 1 + report.requests // heavy_every:
        report.heavy += 1
        return shot
    headers = tuple((k, v) for k, v in shot.headers if k != "Content-Encoding") + (("Content-Encoding", "gzip"),)
    return dataclasses.replace(shot, kind="gzip", body=gzip.compress(b"{}"), stream=0, headers=headers)


PAUSING = ("/pause_generation", "/release_memory_occupation")
"""Routes that stop generation until undone: each such shot is followed at once by ``restore``, or
the batch's generation requests would wait for the end of the batch, which waits for them."""


async def restore(client: Any, engine_url: str) -> None:
    """Undo a pause or a memory release (the KV cache first: resuming is refused while it is released)."""
    for path in ("/resume_memory_occupation", "/continue_generation"):
        await client.post(engine_url + path, timeout=60)


async def send_and_restore(client: Any, target: Target, shot: Any) -> tuple[int | None, str]:
    answer = await send(client, target.url, shot)
    if shot.route in PAUSING:
        await restore(client, target.engine_url)
    return answer


async def run_batch(client: Any, target: Target, shots: list[Any], report: Report, heavy_every: int, index: int) -> None:
    shots = [lighten(s, report, heavy_every) for s in shots]
    answers = await asyncio.gather(*(send_and_restore(client, target, s) for s in shots))
    for shot, (status, note) in zip(shots, answers):
        judge(report, target, shot, status, note)
    problem = await check_health(client, target, index)
    if problem:
        report.health_failures.append(f"after batch {index}: {problem}")
    for name, pid in target.pids.items():
        report.rss_mb.setdefault(name, []).append(rss_mb(pid))


async def check_health(client: Any, target: Target, index: int) -> str | None:
    """Undo a fuzzed pause or memory release, then: alive, ``/health_generate`` 200, the target's probe."""
    import httpx

    for name, pid in target.pids.items():
        if not Path(f"/proc/{pid}").exists():
            return f"{name} (pid {pid}) is gone"
    try:
        await restore(client, target.engine_url)
        r = await client.get(target.url + "/health_generate" if target.name == "router" else target.engine_url + "/health_generate", timeout=60)
        if r.status_code != 200:
            return f"/health_generate answered {r.status_code}: {r.text[:200]}"
        return await target.probe(client, index) if target.probe is not None else None
    except httpx.HTTPError as e:
        return f"no answer: {type(e).__name__}: {e}"


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (``VmRSS`` of ``/proc/PID/status``); 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def fuzz_target(target: Target, requests: int, batch: int = 50, seed: int = 0, heavy_every: int = 250) -> Report:
    """``requests`` shots at ``target``, drawn by Hypothesis from ``seed``, ``batch`` at a time."""
    import httpx
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed
    from hypothesis import strategies as st

    from noria.bench.fuzz_strategies import shots

    report = Report(target.name)
    strategy = st.one_of([shots(target.name, spec, target.fill, target.limit) for spec in target.specs])
    loop = asyncio.new_event_loop()
    # A connection per request: one the server closed after a broken request is never reused (which
    # would read as the next request going unanswered).
    limits = httpx.Limits(max_connections=batch + 4, max_keepalive_connections=0)
    client = httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits)
    pending: list[Any] = []

    def flush() -> None:
        loop.run_until_complete(run_batch(client, target, list(pending), report, heavy_every, report.requests // batch))
        pending.clear()

    def consume(shot: Any) -> None:
        pending.append(shot)
        if len(pending) == batch:
            flush()

    run = settings(max_examples=requests, database=None, deadline=None, phases=[Phase.generate], derandomize=False,
                   suppress_health_check=list(HealthCheck), print_blob=False)(with_seed(seed)(given(strategy)(consume)))  # fmt: skip
    start = time.perf_counter()
    try:
        run()
        if pending:
            flush()
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
    report.seconds = time.perf_counter() - start
    return report


# ------------------------------------------------------------------------------------ the rig


@dataclass
class Rig:
    """The fuzzed processes (module docstring) and the targets over them."""

    engine: Any
    router: Any
    sessions: Any
    engine_url: str
    session_info: dict[str, Any]
    targets: dict[str, Target] = field(default_factory=dict)

    def close(self) -> None:
        for part in (self.router, self.sessions, self.engine):
            if part is not None:
                part.stop()


def start_engine(model: str, log_dir: Path) -> tuple[Any, str]:
    from noria.net import free_port
    from noria.process import Child

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "noria", "serve", "--model", model, "--port", str(port), "--engine-id", "fuzz",
           "--engine.kv_cache_tokens", "8192", "--drain-timeout", "2"]  # fmt: skip
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return Child.start(cmd, name=f"noria serve at {url}", log_path=log_dir / "engine.log", env=env), url


def start_sessions(model: str, engine_url: str, log_dir: Path, probes: int) -> tuple[Any, Path]:
    from noria.process import Child

    info = log_dir / "sessions.json"
    info.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "noria.bench.fuzz", "serve-sessions", "--model", model, "--engine-url", engine_url,
           "--info", str(info), "--probes", str(probes)]  # fmt: skip
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return Child.start(cmd, name="fuzzed session server", log_path=log_dir / "sessions.log", env=env), info


def start_rig(model: str, log_dir: Path, probes: int = 2000) -> Rig:
    """Engine, session server and router started, ready, with their targets."""
    from noria.router.sglang_router import SglangRouter

    engine, engine_url = start_engine(model, log_dir)
    rig = Rig(engine, None, None, engine_url, {})
    try:
        rig.sessions, info = start_sessions(model, engine_url, log_dir, probes)
        engine.wait_http(f"{engine_url}/health", 300)
        rig.router = SglangRouter([engine_url], log_path=log_dir / "router.log").start(timeout_s=120)
        rig.sessions.wait_ready(lambda: info.exists() and bool(info.read_text()), 300, "serving sessions")
        rig.session_info = json.loads(info.read_text())
        rig.targets = build_targets(rig, model)
    except BaseException:
        rig.close()
        raise
    return rig


def build_targets(rig: Rig, model: str) -> dict[str, Target]:
    from hypothesis import strategies as st

    from noria.bench.fuzz_strategies import engine_specs, router_specs, session_specs
    from noria.engine.server.app import BODY_BYTES

    from noria.models.catalog import model_path

    engine = engine_specs(str(model_path(model)), small_tensors(rig.engine_url))
    info = rig.session_info
    sid = st.sampled_from(info["sessions"]) | st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=8)
    return {
        "engine": Target("engine", rig.engine_url, engine, {}, BODY_BYTES, {"engine": rig.engine.pid}, rig.engine_url),
        "session": Target("session", f"http://127.0.0.1:{info['port']}", session_specs(), {"secret": st.just(info["secret"]), "sid": sid},
                          1 << 20, {"session server": info["pid"], "engine": rig.engine.pid}, rig.engine_url, session_probe(info)),
        "router": Target("router", rig.router.url, router_specs(engine), {}, BODY_BYTES,
                         {"engine": rig.engine.pid, "router": rig.router.process.pid}, rig.engine_url),
    }  # fmt: skip


def small_tensors(engine_url: str, most: int = 1024) -> dict[str, list[int]]:
    """The engine's tensors of at most ``most`` elements (name -> shape): a valid weight update fits a shot."""
    import httpx

    specs = httpx.get(f"{engine_url}/weights_info", timeout=60).json()["tensors"]
    out = {}
    for name, spec in specs.items():
        n = 1
        for d in spec["shape"]:
            n *= d
        if n <= most and spec["dtype"] == "float32":
            out[name] = spec["shape"]
    return out


BOUND_ANSWERS = {429: "rollout.session_max_open", 410: "rollout.session_idle_timeout_s"}
"""A probe session's documented refusals: all places taken; closed idle before its turn (the rig's
refresher opens it again within 0.2 s, the reaper may close it first: both are right answers)."""


def session_probe(info: dict[str, Any]) -> Any:
    """The session server's health: a first turn on an unused probe session is a chat completion, or
    one of its bounds' answers naming its option (``BOUND_ANSWERS``)."""

    async def probe(client: Any, index: int) -> str | None:
        url = f"http://127.0.0.1:{info['port']}/{info['secret']}/sessions/probe-{index}/v1/chat/completions"
        r = await client.post(url, json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        if r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant":
            return None
        if r.status_code in BOUND_ANSWERS and r.json()["error"]["param"] == BOUND_ANSWERS[r.status_code]:
            return None
        return f"probe turn answered {r.status_code}: {r.text[:200]}"

    return probe


# ------------------------------------------------------------------------------------ the session server's process


def serve_sessions(argv: list[str]) -> None:
    """The rig's session server (``python -m noria.bench.fuzz serve-sessions``): sessions over the
    engine, refreshed so that fresh ones keep coming; writes its address to ``--info``."""
    p = argparse.ArgumentParser(prog="python -m noria.bench.fuzz serve-sessions")
    p.add_argument("--model", required=True)
    p.add_argument("--engine-url", required=True)
    p.add_argument("--info", required=True)
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--probes", type=int, default=2000)
    args = p.parse_args(argv)
    from noria.process.lifecycle import sigterm_as_interrupt

    sigterm_as_interrupt()
    try:
        asyncio.run(_serve_sessions(args))
    except KeyboardInterrupt:
        pass


async def _serve_sessions(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from noria.agent.session import SessionLimits, SessionServer
    from noria.engine.protocol import SamplingParams
    from noria.models.catalog import model_path
    from noria.rollout.client import HttpEngineClient

    tokenizer = AutoTokenizer.from_pretrained(str(model_path(args.model)))
    engine = HttpEngineClient(args.engine_url, timeout_s=60)
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0)
    async with SessionServer(engine, tokenizer, sampling, limits=SessionLimits(**SESSION_LIMITS)) as server:
        pool = [f"fuzz-{i}" for i in range(args.sessions)]
        for sid in pool + [f"probe-{i}" for i in range(args.probes)]:
            server.open(sid)
        info = {"port": server.port, "secret": server.secret, "sessions": pool, "pid": os.getpid()}
        Path(args.info + ".part").write_text(json.dumps(info))
        os.replace(args.info + ".part", args.info)  # whole or absent for the driver that waits for it
        while True:
            await asyncio.sleep(0.2)
            refresh(server)


def refresh(server: Any) -> None:
    """Close and open again every session that is used up (a turn taken, failed, capped or closed
    idle) and has nothing in flight: its place is freed and a fresh session takes its id."""
    for sid, s in list(server.sessions.items()):
        if s.pending == 0 and (s.turns or s.error or s.capped or s.closed or s.last_finish):
            server.close(sid)
            server.open(sid)


# ------------------------------------------------------------------------------------ command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``noria bench fuzz``'s arguments."""
    parser.description = ("Fuzz every HTTP route of noria serve, the session server and the sglang-router front with "
                          "Hypothesis strategies and concurrency; fail on an undocumented 5xx, a request without an "
                          "answer, a failed health check or RSS growth (module docstring of noria.bench.fuzz).")  # fmt: skip
    parser.add_argument("--model", default="tiny-llama", help="catalog name or model folder served by the rig")
    parser.add_argument("--requests", type=int, default=50_000, help="requests in all, split over the targets by --shares")
    parser.add_argument("--shares", default="engine=0.5,session=0.3,router=0.2", help="share of the requests per target")
    parser.add_argument("--batch", type=int, default=50, help="requests sent at once; the health check runs after each batch")
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed: the same seed sends the same requests")
    parser.add_argument("--heavy-every", type=int, default=250, help="at most one 64 MiB body (oversize, gzip bomb) per this many requests")
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args: argparse.Namespace) -> int:
    from noria.bench import print_table, write_json

    from noria.models.catalog import model_path

    shares = {k: float(v) for k, v in (item.split("=") for item in args.shares.split(","))}
    model = str(model_path(args.model))  # a catalog model is built here once, not by each process of the rig
    check_coverage(model)
    with tempfile.TemporaryDirectory(prefix="noria-fuzz-") as folder:
        rig = start_rig(model, Path(folder), probes=args.requests // args.batch + 10)
        try:
            reports = [fuzz_target(rig.targets[name], int(args.requests * share), args.batch, args.seed, args.heavy_every)
                       for name, share in shares.items()]  # fmt: skip
        finally:
            rig.close()
    rows = [[r.target, r.requests, r.requests / r.seconds, sum(v for k, v in r.statuses.items() if k.startswith("2")),
             sum(v for k, v in r.statuses.items() if k.startswith("4")), sum(v for k, v in r.statuses.items() if k[0] == "5"),
             r.statuses["none"], len(r.failures), len(r.health_failures),
             " ".join(f"{n} {max(v):.0f}" for n, v in r.rss_mb.items()), " ".join(f"{g:+.0f}" for g in r.rss_growth().values())]
            for r in reports]  # fmt: skip
    print_table("fuzz: requests per target, answers, failures, RSS (MiB)",
                ["target", "requests", "req/s", "2xx", "4xx", "5xx", "no answer", "failures", "health fails", "RSS max", "RSS growth"], rows)  # fmt: skip
    problems = [f"{r.target}: {p}" for r in reports for p in r.problems()]
    for p in problems:
        print("FAIL", p)
    if args.json:
        write_json(args.json, "fuzz", results(reports))
    return 1 if problems else 0


def results(reports: list[Report]) -> list[dict[str, Any]]:
    """The JSON cases: per target its counts and RSS growth; the failures found and fixed before."""
    out = []
    for r in reports:
        growth = r.rss_growth()
        out += [
            {"case": r.target, "metric": "requests", "noria": r.requests, "peers": {}, "bound": None,
             "detail": {"statuses": dict(r.statuses), "kinds": dict(r.kinds), "seconds": round(r.seconds, 1)}},
            {"case": r.target, "metric": "distinct_failures", "noria": len(r.failures) + len(r.health_failures), "peers": {}, "bound": 0,
             "detail": {"failures": r.failures, "health": r.health_failures}},
            {"case": r.target, "metric": "rss_growth_mb", "noria": round(max(growth.values(), default=0.0), 1), "peers": {},
             "bound": RSS_SLACK_MB[r.target], "detail": {n: {"max": max(v), "first": v[0], "last": v[-1]} for n, v in r.rss_mb.items()}},
        ]  # fmt: skip
    out.append({"case": "all", "metric": "failures_found_and_fixed", "noria": len(FIXED), "peers": {}, "bound": None,
                "detail": [{"failure": f, "regression_test": t} for f, t in FIXED]})  # fmt: skip
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve-sessions"]:
        serve_sessions(sys.argv[2:])
    else:
        sys.exit("usage: python -m noria.bench.fuzz serve-sessions ... (the benchmark itself is `noria bench fuzz`)")
