"""The engine serving a tiny random Qwen3-MoE on CPU, and the routes it returns (routing replay).

Every recorded route is checked against a fresh forward of the token's own sequence (prefix
only) in deterministic mode: the route of output token i is the routers' top-k at the position
that produced its logits. Retraction, re-prefill, a pause and a weight update mid-request must not
rewrite a route: the update renumbers the experts (the same function, other expert ids), so a
route recomputed after it would show. Also: per-expert HF folders staged by update_from_disk, and
``return_routed_experts`` over HTTP through a real ``noria serve``.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
import torch

from engine_server_util import ServeProcess
from moe_util import fresh_routes, load_exact, permuted_experts, tiny_moe_folder
from noria.config import EngineConfig
from noria.engine import Engine, GenerateRequest, SamplingParams
from noria.engine.protocol import RequestError, decode_routes
from noria.models import load_model, save_model
from noria.models.moe import route_mismatch

PROMPT_LENS = [3, 11, 40, 70]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_moe_folder(tmp_path_factory.mktemp("moe"))


def engine_for(folder, dtype=torch.bfloat16, deterministic=True, **overrides) -> Engine:
    settings = dict(kv_cache_tokens=4096, block_size=4, chunked_prefill_size=24, max_batch_tokens=48, attention="torch")
    config = EngineConfig(deterministic=deterministic, **{**settings, **overrides})
    return Engine(load_model(folder, dtype=dtype), None, config)


def request(prompt: list[int], new_tokens: int, seed: int, routes: bool = True) -> GenerateRequest:
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=seed)
    return GenerateRequest(input_ids=prompt, sampling=params, return_routed_experts=routes)


def prompts(lens=PROMPT_LENS, vocab: int = 300) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]


def assert_routes_of_a_fresh_forward(model, prompt: list[int], out) -> None:
    """Output token i's route equals the model's own route at position len(prompt) - 1 + i."""
    seq = prompt + out.output_ids
    want = fresh_routes(model, seq[:-1], exact=True)[len(prompt) - 1 :]
    assert out.routed_experts.shape == want.shape and out.routed_experts.dtype == torch.int8
    assert route_mismatch(out.routed_experts, want) == (0, want.shape[0] * want.shape[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_routes_equal_a_fresh_forward_of_each_sequence(folder, dtype):
    engine = engine_for(folder, dtype)
    ps = prompts()
    try:
        outs = engine.generate_batch([request(p, 12, seed) for seed, p in enumerate(ps)])
        # Again through the prefix cache: cached prompt tokens are not recomputed, the routes of the
        # sampled tokens are still recorded.
        again = engine.generate_batch([request(ps[-1], 12, 100)])
    finally:
        engine.shutdown(1)
    assert again[0].cached_tokens > 0
    model = load_exact(folder, dtype)
    for p, out in zip(ps + ps[-1:], outs + again):
        assert len(out.output_ids) == 12
        assert_routes_of_a_fresh_forward(model, p, out)


def test_routes_only_on_request_and_only_for_moe(folder, tiny_model_dir):
    engine = engine_for(folder, deterministic=False)
    try:
        plain, routed = engine.generate_batch([request(prompts()[0], 4, 0, routes=False), request(prompts()[0], 4, 0)])
    finally:
        engine.shutdown(1)
    assert plain.routed_experts is None and plain.meta_info().get("routed_experts") is None
    assert routed.output_ids == plain.output_ids and routed.routed_experts.shape == (4, 2, 2)
    dense = Engine(load_model(tiny_model_dir), None, EngineConfig(kv_cache_tokens=512, attention="torch"))
    try:
        with pytest.raises(RequestError, match="no MoE layer"):
            dense.submit(request([5, 6], 2, 0), lambda out: None)
    finally:
        dense.shutdown(1)


def test_routes_survive_retraction_and_re_prefill(folder):
    """A cache too small for every request at once: requests are retracted and re-prefilled with
    their output so far; every token keeps the route it was sampled with."""
    engine = engine_for(folder, kv_cache_tokens=160, max_batch_tokens=64)
    ps = prompts([20, 24, 28, 30])
    try:
        outs = engine.generate_batch([request(p, 24, seed) for seed, p in enumerate(ps)], timeout_s=300)
        retractions = engine.scheduler.retractions
    finally:
        engine.shutdown(1)
    assert retractions > 0
    model = load_exact(folder, torch.bfloat16)
    for p, out in zip(ps, outs):
        assert_routes_of_a_fresh_forward(model, p, out)


def test_routes_belong_to_the_weight_version_that_sampled_each_token(folder):
    """Generate, pause with retraction mid-request, update to the same model with its experts
    renumbered, resume: tokens before the update carry routes of version 0, after it of version 1,
    each equal to a fresh forward with that version's weights (a recomputed route would carry the
    new numbering)."""
    engine = engine_for(folder)
    prompt = prompts([9])[0]
    progressed = threading.Event()
    done = threading.Event()
    results = []

    def on_output(out):
        if len(out.output_ids) >= 10:
            progressed.set()
        if out.finished:
            results.append(out)
            done.set()

    v0 = load_exact(folder, torch.bfloat16)
    renumbered = permuted_experts(v0)
    try:
        engine.submit(request(prompt, 30, 3), on_output, stream=True)
        assert progressed.wait(120)
        asyncio.run(engine.pause("retract"))
        engine.weights.update_from_state_dict(renumbered, version=1)
        asyncio.run(engine.resume())
        assert done.wait(120)
    finally:
        engine.shutdown(1)
    out = results[0]
    versions = torch.tensor(out.weight_versions)
    assert 0 < int((versions == 0).sum()) < len(versions) and set(versions.tolist()) == {0, 1}
    v1 = load_exact(folder, torch.bfloat16)
    v1.load_state_dict(renumbered)
    seq = prompt + out.output_ids
    start = len(prompt) - 1
    per_version = {v: fresh_routes(m, seq[:-1], exact=True)[start:] for v, m in ((0, v0), (1, v1))}
    for v in (0, 1):
        rows = versions == v
        assert route_mismatch(out.routed_experts[rows], per_version[v][rows]) == (0, int(rows.sum()) * 2)
        # The renumbering is visible: the other version's routes differ for most of these tokens.
        differing, total = route_mismatch(out.routed_experts[rows], per_version[1 - v][rows])
        assert differing > total // 2


def test_update_from_a_per_expert_hf_folder(folder, tmp_path):
    """update_from_disk of a folder that save_model wrote (one tensor per expert) loads the
    stacked experts; a folder missing one expert is refused, naming it, and changes nothing."""
    engine = engine_for(folder, dtype=torch.float32, deterministic=False)
    model = load_model(folder)
    renumbered = permuted_experts(model)
    model.load_state_dict(renumbered)
    new = save_model(model, tmp_path / "v1")
    try:
        engine.weights.update_from_disk(new, version=1)
        live = engine.model.state_dict()
        for name, t in renumbered.items():
            assert torch.equal(live[name], t), name
        from safetensors.torch import load_file, save_file

        broken = tmp_path / "broken"
        save_model(model, broken)
        state = load_file(broken / "model.safetensors")
        del state["model.layers.0.mlp.experts.5.gate_proj.weight"]
        save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(Exception, match=r"experts\.5\.gate_proj\.weight"):
            engine.weights.update_from_disk(broken, version=2)
        assert engine.weight_version == 1
        assert torch.equal(engine.model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"],
                           renumbered["model.layers.0.mlp.experts.gate_up_proj"])
    finally:
        engine.shutdown(1)


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory, tiny_model_dir):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tiny_model_dir))
    folder = tiny_moe_folder(tmp_path_factory.mktemp("moe-http"), tokenizer_dir=tiny_model_dir, vocab=vocab)
    server = ServeProcess(folder, "--dtype", "float32", "--engine.deterministic", "true", "--engine.attention", "torch",
                          log_dir=tmp_path_factory.mktemp("logs"))
    try:
        yield server.wait_ready(), folder
    finally:
        server.stop()


def test_http_generate_returns_routed_experts(moe_server):
    server, folder = moe_server
    prompt = [5, 17, 33, 9, 41, 12]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    plain = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert "routed_experts" not in plain["meta_info"]
    data = httpx.post(f"{server.url}/generate", json={**body, "return_routed_experts": True}, timeout=60).json()
    info = data["meta_info"]
    assert info["routed_experts_shape"] == [6, 2, 2]
    routes = decode_routes(info, len(data["output_ids"]))
    model = load_exact(folder, torch.float32)
    seq = prompt + data["output_ids"]
    want = fresh_routes(model, seq[:-1], exact=True)[len(prompt) - 1 :]
    assert route_mismatch(routes, want) == (0, 12)
    bad = httpx.post(f"{server.url}/generate", json={**body, "return_routed_experts": "yes"}, timeout=60)
    assert bad.status_code == 400 and "return_routed_experts" in bad.text


def test_session_records_each_policy_tokens_route_and_none_for_the_environment(tiny_model_dir, tmp_path):
    """Multi-turn through the session server (routes asked for): every policy token carries the
    route the engine sampled it with, tool output tokens a -1 row; the sample packs them."""
    from transformers import AutoTokenizer

    from noria.agent.session import SessionServer
    from noria.rollout import LocalEngineClient
    from noria.router import LocalRouter
    from noria.train.packing import pack_samples
    from noria.types import Sample

    vocab = len(AutoTokenizer.from_pretrained(tiny_model_dir))
    folder = tiny_moe_folder(tmp_path, tokenizer_dir=tiny_model_dir, vocab=vocab)
    engine = Engine.from_path(folder, EngineConfig(kv_cache_tokens=4096, deterministic=True, attention="torch"),
                              dtype="float32", seed=0)

    async def run():
        sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=1)
        router = LocalRouter([LocalEngineClient(engine)])
        async with SessionServer(router, engine.tokenizer, sampling, routes=True) as server:
            server.open("s1", seed=7)
            messages = [{"role": "user", "content": "What is 3 + 4?"}]
            for turn in range(3):
                async with httpx.AsyncClient(timeout=120) as client:
                    r = await client.post(f"{server.base_url('s1')}/chat/completions", json={"messages": messages})
                messages += [r.json()["choices"][0]["message"], {"role": "tool", "content": f"result {turn}"}]
            return server.close("s1")

    try:
        session = asyncio.run(run())
    finally:
        engine.shutdown(1)
    sample = session.fill(Sample(prompt_ids=[]))
    routes, mask = sample.routed_experts, torch.tensor(sample.loss_mask)
    assert routes.shape == (len(sample.response_ids), 2, 2) and mask.sum() > 0 and (mask == 0).any()
    assert (routes[mask == 0] == -1).all() and (routes[mask == 1] >= 0).all()
    model = load_exact(folder, torch.float32)
    seq = sample.prompt_ids + sample.response_ids
    own = fresh_routes(model, seq[:-1], exact=True)[len(sample.prompt_ids) - 1 :]
    assert route_mismatch(routes[mask == 1], own[mask == 1]) == (0, int(mask.sum()) * 2)
    batch = pack_samples([sample], replay_routes=True)
    assert torch.equal(batch.routed_experts[len(sample.prompt_ids):][mask == 1], routes[mask == 1])


def test_sglang_routes_keep_the_rows_of_the_output_tokens():
    """An SGLang server sends one row per position but the last (prompt included) and no shape:
    the output token i's route is row prompt_len - 1 + i, the last R rows."""
    from noria.engine.protocol import encode_routes

    prompt, out = 5, 3
    every_position = torch.arange((prompt + out - 1) * 2 * 2, dtype=torch.int32).view(prompt + out - 1, 2, 2)
    info = {**encode_routes(every_position), "prompt_tokens": prompt}
    del info["routed_experts_shape"]
    routes = decode_routes(info, out)
    assert torch.equal(routes, every_position[prompt - 1 :].reshape(out, 4))
    with pytest.raises(RequestError, match="not a whole number"):
        decode_routes({**info, "prompt_tokens": prompt + 1}, out)
