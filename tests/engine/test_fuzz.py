"""Fuzzing every HTTP route of ``noria serve``, the session server and the sglang-router front (CPU,
127.0.0.1 only; the real servers of ``noria.bench.fuzz``'s rig on the tiny model, the real router).

A fixed budget of 5,100 requests in all, drawn by Hypothesis from a fixed seed (the same requests
every run), 50 at a time: no undocumented 5xx, every request answered, every server healthy after
each batch, resident memory flat after the warm-up. ``noria bench fuzz --requests N`` is the long
run. The route tables come from the servers themselves; a route without a strategy fails here.
"""

from __future__ import annotations

import json

import pytest
from engine_server_util import deflate_among_good_codes, split_deflate_status

from noria.bench import fuzz
from noria.bench.fuzz_strategies import ROUTER_PATHS, RouteSpec, engine_specs, router_specs, session_specs

pytestmark = [pytest.mark.router, pytest.mark.timeout(240)]

BUDGET = {"engine": 2600, "session": 1500, "router": 1000}
"""Requests per target (5,100 in all)."""


@pytest.fixture(scope="module")
def rig(tiny_model_dir, tmp_path_factory):
    rig = fuzz.start_rig(str(tiny_model_dir), tmp_path_factory.mktemp("fuzz-rig"), probes=200)
    yield rig
    rig.close()


def test_every_route_of_every_server_has_a_strategy(tiny_model_dir):
    from transformers import AutoTokenizer

    engine = fuzz.engine_paths()
    assert {"/generate", "/v1/chat/completions", "/update_weights_from_tensor", "/health_generate"} <= engine  # read from the app
    assert fuzz.uncovered(engine, engine_specs()) == []
    sessions = fuzz.session_paths(AutoTokenizer.from_pretrained(tiny_model_dir))
    assert "/{secret}/sessions/{sid}/v1/chat/completions" in sessions
    assert fuzz.uncovered(sessions, session_specs()) == []
    assert [s.path for s in router_specs(engine_specs())] == list(ROUTER_PATHS)


def test_a_route_without_a_strategy_is_reported():
    """The check above cannot pass vacuously: a route the specs lack is named."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/new_route", lambda r: None)
    app.router.add_get("/generate", lambda r: None)
    assert fuzz.uncovered(fuzz.app_paths(app), [RouteSpec("/generate")]) == ["/new_route"]


@pytest.mark.parametrize("target", list(BUDGET))
def test_fuzz_budget_passes(rig, target):
    report = fuzz.fuzz_target(rig.targets[target], BUDGET[target], batch=50, seed=0, heavy_every=1000)
    assert report.requests == BUDGET[target]
    assert report.problems() == []
    assert len(report.rss_mb[next(iter(report.rss_mb))]) == BUDGET[target] // 50  # a health check after every batch
    answered = {k for k in report.statuses if k.startswith(("2", "4"))}
    assert any(k.startswith("2") for k in answered) and any(k.startswith("4") for k in answered)  # both sides were reached


def test_the_judge_flags_an_undocumented_5xx_and_a_request_without_an_answer(rig):
    """The pass criterion cannot pass vacuously: a 500 and a dropped connection are failures."""
    from noria.bench.fuzz_strategies import Shot

    report = fuzz.Report("engine")
    shot = Shot("engine", "/generate", "valid", "POST", "/generate", (), b"{}")
    fuzz.judge(report, rig.targets["engine"], shot, 500, "boom 12")
    fuzz.judge(report, rig.targets["engine"], shot, None, "RemoteProtocolError: closed")
    fuzz.judge(report, rig.targets["engine"], shot, 400, "bad")
    assert len(report.failures) == 2 and report.requests == 3


# ---------------------------------------------------------------------------------------- what the fuzzer found

GOOD = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}}
ENGINE_500S = [
    pytest.param("/generate", {"Content-Encoding": "gzip"}, b'{"input_ids": [5]}', "cannot be read", id="bogus-content-encoding"),
    pytest.param("/generate", {}, b"[" * 5000, "nests too deeply", id="json-nested-5000-deep"),
    pytest.param("/generate", {}, b'{"text": "\\ud800"}', "cannot be tokenized", id="generate-lone-surrogate"),
    pytest.param("/v1/completions", {}, b'{"prompt": ["a", "\\ud800"]}', "cannot be tokenized", id="completions-lone-surrogate"),
    pytest.param("/v1/chat/completions", {}, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "cannot be tokenized",
                 id="chat-lone-surrogate"),
    pytest.param("/weights_checksum", {}, b'{"names": [{"a": 1}]}', "names", id="checksum-names-not-strings"),
    pytest.param("/init_weights_update_group", {}, b'{"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, '
                 b'"world_size": 0, "timeout_s": 0.1}', "rank_offset", id="join-world-size-0"),
    pytest.param("/init_weights_update_group", {}, b'{"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, '
                 b'"world_size": 2, "backend": "nccl", "timeout_s": 0.1}', "nccl", id="join-nccl-on-a-cpu-engine"),
    pytest.param("/update_weights_from_disk", {}, b'{"model_path": "' + b"a" * 300 + b'"}', "model_path", id="disk-path-too-long"),
]  # fmt: skip


@pytest.mark.parametrize("path, headers, raw, named", ENGINE_500S)
def test_fuzz_regression_engine_answers_400_naming_the_problem_never_500(rig, path, headers, raw, named):
    """Found by the fuzzer: each of these was answered 500 by noria serve (an exception past the
    request's parsing); now a 400 naming what is wrong, and the engine goes on serving."""
    import httpx

    r = httpx.post(rig.engine_url + path, content=raw, headers={"Content-Type": "application/json", **headers}, timeout=60)
    assert r.status_code == 400 and named in r.json()["error"]["message"], r.text
    assert httpx.post(rig.engine_url + "/generate", json=GOOD, timeout=60).status_code == 200


def test_fuzz_regression_every_deflate_body_is_answered_and_the_connections_go_on_serving(rig):
    """Found by the fuzzer (one unanswered request in 2,600, then reproduced: 61 of 80 concurrent
    POSTs of a 2-byte body with ``Content-Encoding: deflate`` never answered, aiohttp's decoder having
    failed at the body's end). Every one is now answered, 415 from noria serve (or aiohttp's own 400
    when the body came with the headers), and requests after them on the same client are answered."""
    import asyncio

    assert asyncio.run(split_deflate_status(rig.engine_url + "/discard_weights")) == 415  # its end after the headers
    codes = asyncio.run(deflate_among_good_codes(rig.engine_url + "/discard_weights", b"{}"))  # an unanswered one times out
    assert set(codes[1::2]) <= {415, 400} and 415 in codes[1::2] and set(codes[::2]) == {200}, codes


def test_fuzz_regression_the_engine_never_hosts_a_weight_group_a_client_asks_for(rig):
    """Found by the fuzzer: rank_offset 0 made the engine rank 0 of a group of the client's choosing
    (a store listening on the client's port, a gloo group kept for good); the trainer is rank 0."""
    import httpx

    body = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 1, "group_name": "mine", "timeout_s": 0.1}
    r = httpx.post(rig.engine_url + "/init_weights_update_group", json=body, timeout=60)
    assert r.status_code == 400 and "rank_offset must be in [1, world_size)" in r.json()["error"]["message"], r.text


def test_fuzz_regression_a_streamed_request_with_an_id_in_flight_is_400_not_a_cut_stream(rig):
    """Found by the fuzzer: a streamed /generate whose rid was already in flight was answered 200 and
    then cut off (the id was checked after the stream started); now 400 before any byte is sent."""
    import httpx

    url = rig.engine_url
    first = {"input_ids": [5, 6], "rid": "twice", "stream": True, "sampling_params": {"max_new_tokens": 8}}
    with httpx.Client(timeout=60) as client:
        assert client.post(url + "/pause_generation", json={"mode": "in_place"}).status_code == 200  # the first waits, in flight
        try:
            with client.stream("POST", url + "/generate", json=first) as stream:  # its headers are in: its id is claimed
                assert stream.status_code == 200
                second = client.post(url + "/generate", json=first)
                assert client.post(url + "/continue_generation").status_code == 200
                lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        finally:
            client.post(url + "/continue_generation")
    assert second.status_code == 400 and "already in flight" in second.json()["error"]["message"], second.text
    assert lines[-1] == "data: [DONE]" and len(lines) > 1  # the first one ends whole


def test_fuzz_regression_refused_streamed_requests_do_not_take_the_engine_out_of_the_router(rig):
    """Found by the fuzzer: sglang-router's circuit breaker counted an engine's 400 to a streamed
    request as the engine failing; ten of them from one client and the router answered 503 to
    everyone for a minute. Noria starts the router without it."""
    import httpx

    bad = {"input_ids": [5], "stream": True, "sampling_params": {"temperature": -1}}
    assert [httpx.post(rig.router.url + "/generate", json=bad, timeout=60).status_code for _ in range(12)] == [400] * 12
    assert httpx.post(rig.router.url + "/generate", json=GOOD, timeout=60).status_code == 200


@pytest.mark.parametrize("front", ["engine", "router"])
def test_fuzz_regression_an_error_after_a_stream_started_is_its_last_event_not_a_broken_stream(rig, front):
    """Found by the fuzzer (50,000-request run): a streamed request the engine refused once admitted
    (here logprob_start_len past the prompt) got its 400 written into the open stream: an illegal
    chunk for the client, a cut stream through the router. Now the error is the stream's last event
    (as SGLang sends it), then [DONE]."""
    import httpx

    url = rig.engine_url if front == "engine" else rig.router.url
    body = {"input_ids": [5, 6, 7], "stream": True, "logprob_start_len": 3, "sampling_params": {"max_new_tokens": 2}}
    with httpx.Client(timeout=60) as client, client.stream("POST", url + "/generate", json=body) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]", events
    error = json.loads(events[-2])["error"]
    assert error["code"] == 400 and "logprob_start_len" in error["message"]


def test_fuzz_regression_abort_all_leaves_the_health_probe_alone(rig):
    """Found by the fuzzer (50,000-request run): /abort_request with abort_all aborted
    /health_generate's own generation, which then answered 503 unhealthy."""
    import threading
    import time

    import httpx

    url, answers = rig.engine_url, []
    with httpx.Client(timeout=60) as client:
        assert client.post(url + "/pause_generation", json={"mode": "in_place"}).status_code == 200
        probe = threading.Thread(target=lambda: answers.append(httpx.get(url + "/health_generate", timeout=60).status_code))
        try:
            probe.start()
            deadline = time.monotonic() + 30
            while client.get(url + "/get_load").json()["num_inflight_http"] < 1:  # the probe is in flight (paused)
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert client.post(url + "/abort_request", json={"abort_all": True}).json()["aborted"] == []
        finally:
            client.post(url + "/continue_generation")
            probe.join(60)
    assert answers == [200]


@pytest.mark.parametrize("sampling", [{"top_k": 2**63}, {"top_k": 10**30}, {"stop_token_ids": [2**64]}, {"stop_token_ids": [2**63]}],
                         ids=["top-k-2^63", "top-k-1e30", "stop-token-2^64", "stop-token-2^63"])
def test_fuzz_regression_integers_past_64_bits_are_400_and_the_engine_lives(rig, sampling):
    """Found by the fuzzer (second 50,000-request run): a sampling integer past 2^63 passed the checks
    and killed the engine's loop ("Overflow when unpacking long long"); every later request was a 500."""
    import httpx

    r = httpx.post(rig.engine_url + "/generate", json={"input_ids": [5, 6], "sampling_params": {**sampling, "max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 400 and next(iter(sampling)) in r.json()["error"]["message"], r.text
    assert httpx.get(rig.engine_url + "/health_generate", timeout=60).status_code == 200
