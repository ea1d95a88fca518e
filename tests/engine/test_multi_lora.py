"""Many LoRA adapters in one engine (CPU): per-row adapters in one batch, the peft reference, the
registry's slots (LRU eviction, in-use refusal, in-place updates), the prefix cache's namespaces,
and the HTTP surface of a real ``noria serve``.

Adapters are random (B non-zero, so each one changes the logits) and written as peft folders by the
trainer's own ``noria.train.lora.save_adapter``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy

import httpx
import pytest
import torch

from engine_server_util import ServeProcess
from noria.config import EngineConfig, LoraConfig
from noria.engine.engine import Engine
from noria.engine.lora import AdapterError
from noria.engine.protocol import GenerateRequest, RequestError, SamplingParams
from noria.train.lora import apply_lora, save_adapter

TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")
PROMPT = [3, 17, 42, 7, 99, 5, 23, 61, 8, 14, 31, 2, 77, 40, 9, 12, 55, 6]


def adapter_folder(model, folder, seed: int, rank: int = 4):
    """A peft adapter folder for ``model`` with random A and B (what a trained adapter looks like)."""
    cfg = LoraConfig(rank=rank, alpha=2 * rank, target_modules=list(TARGETS))
    peft_model = apply_lora(copy.deepcopy(model), cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return save_adapter(peft_model.named_parameters(), cfg, folder, "tiny")


@pytest.fixture(scope="module")
def folders(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: adapter_folder(model, root / name, seed) for seed, name in enumerate("abcd")}


def make_engine(model, **overrides) -> Engine:
    return Engine(model, None, EngineConfig(kv_cache_tokens=2048, block_size=4, **overrides))


def scored(engine: Engine, adapters: list, new: int = 6, score: bool = True) -> list:
    """Greedy outputs (with prompt scoring, which the prefix cache never serves, unless not
    ``score``), one request per entry of ``adapters``, in one batch."""
    reqs = [
        GenerateRequest(list(PROMPT), SamplingParams(max_new_tokens=new, temperature=0.0), adapter=a, logprob_start_len=1 if score else -1)
        for a in adapters
    ]
    return engine.generate_batch(reqs, timeout_s=60)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fp32"])
def test_a_mixed_batch_gives_each_row_its_adapter_alone(model, folders, deterministic):
    engine = make_engine(model, deterministic=deterministic, prefix_cache=False)
    try:
        engine.load_adapter("a", folders["a"])
        engine.load_adapter("b", folders["b"])
        mixed = scored(engine, ["a", None, "b", "a", None])
        for out, name in zip(mixed, ["a", None, "b", "a", None]):
            alone = scored(engine, [name])[0]
            assert out.output_ids == alone.output_ids
            got = out.input_logprobs + out.logprobs
            want = alone.input_logprobs + alone.logprobs
            if deterministic:
                assert got == want, name
            else:
                assert max(abs(x - y) for x, y in zip(got, want)) <= 1e-5, name
        base, a, b = mixed[1], mixed[0], mixed[2]
        assert base.input_logprobs != a.input_logprobs != b.input_logprobs  # the adapters do change the rows
        assert a.meta_info()["adapter"] == "a" and a.meta_info()["adapter_version"] == 0
        assert "adapter" not in base.meta_info()
    finally:
        engine.shutdown()


def test_adapter_logits_equal_transformers_with_peft(model, folders, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(folders["c"])).eval()
    with torch.no_grad():
        logits = peft_model(torch.tensor([PROMPT])).logits[0].float()
    want = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    engine = make_engine(model)
    try:
        engine.load_adapter("c", folders["c"])
        out, base = scored(engine, ["c", None], new=1)
        got = torch.tensor(out.input_logprobs)
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
        assert (torch.tensor(base.input_logprobs) - want).abs().max() > 1e-3  # the base model's differ
    finally:
        engine.shutdown()


def test_lru_eviction_and_in_use_adapters_stay(model, folders):
    engine = make_engine(model, lora_max_adapters=2)
    try:
        engine.load_adapter("a", folders["a"])
        engine.load_adapter("b", folders["b"])
        scored(engine, ["a"], new=1)  # a is now the more recently used
        engine.load_adapter("c", folders["c"])  # evicts b, the least recently used
        assert set(engine.adapters()) == {"a", "c"}
        with pytest.raises(RequestError, match="unknown adapter 'b'"):
            engine.submit(GenerateRequest([1, 2], adapter="b"), lambda out: None)
        asyncio.run(engine.pause("in_place"))  # requests are taken (and pin their adapter) but wait
        done: list[concurrent.futures.Future] = []
        for name in ("a", "c"):
            future = concurrent.futures.Future()
            engine.submit(GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=2), adapter=name), future.set_result)
            done.append(future)
        assert {n: i["in_use"] for n, i in engine.adapters().items()} == {"a": 1, "c": 1}
        with pytest.raises(AdapterError, match="cannot load adapter 'd': all 2 slots"):
            engine.load_adapter("d", folders["d"])
        with pytest.raises(AdapterError, match="adapter 'a' is in use by 1 request"):
            engine.unload_adapter("a")
        asyncio.run(engine.resume())
        assert all(f.result(timeout=30).finish_reason["type"] == "length" for f in done)
        engine.load_adapter("d", folders["d"])  # slots free again: a (least recently used) goes
        assert set(engine.adapters()) == {"c", "d"}
        engine.unload_adapter("c")
        assert set(engine.adapters()) == {"d"}
    finally:
        engine.shutdown()


def test_update_in_place_changes_outputs_and_bumps_the_version(model, folders):
    from safetensors.torch import load_file

    engine = make_engine(model)
    try:
        engine.load_adapter("a", folders["a"])
        before = scored(engine, ["a"])[0]
        slot = engine.adapters()["a"]["slot"]
        engine.update_adapter("a", load_file(str(folders["b"] / "adapter_model.safetensors")), version=5)
        after = scored(engine, ["a"])[0]
        assert engine.adapters()["a"]["version"] == 5 and engine.adapters()["a"]["slot"] == slot
        assert after.meta_info()["adapter_version"] == 5
        assert after.input_logprobs != before.input_logprobs
        engine.load_adapter("b", folders["b"])
        as_b = scored(engine, ["b"])[0].input_logprobs  # a now holds b's weights (in another slot: not bitwise)
        assert max(abs(x - y) for x, y in zip(as_b, after.input_logprobs)) <= 1e-5
        bad = {k: v[:, :2] if "lora_A" in k else v for k, v in load_file(str(folders["b"] / "adapter_model.safetensors")).items()}
        with pytest.raises(AdapterError, match="adapter 'a': module .* has A"):
            engine.update_adapter("a", bad, version=6)
        nan = {k: torch.full_like(v, float("nan")) for k, v in load_file(str(folders["b"] / "adapter_model.safetensors")).items()}
        with pytest.raises(AdapterError, match="non-finite"):
            engine.update_adapter("a", nan, version=6)
        assert engine.adapters()["a"]["version"] == 5
    finally:
        engine.shutdown()


def test_the_prefix_cache_never_hands_one_adapters_kv_to_another(model, folders):
    engine = make_engine(model)
    fresh = make_engine(model, prefix_cache=False)
    try:
        for e in (engine, fresh):
            e.load_adapter("a", folders["a"])
            e.load_adapter("b", folders["b"])
        first = scored(engine, ["a"], score=False)[0]
        assert first.cached_tokens == 0
        again = scored(engine, ["a"], score=False)[0]
        assert again.cached_tokens > 0 and close(again.logprobs, first.logprobs)  # a's own KV is reused
        for name in ("b", None):
            out = scored(engine, [name], score=False)[0]
            assert out.cached_tokens == 0, name
            assert close(out.logprobs, scored(fresh, [name], score=False)[0].logprobs), name
        assert scored(engine, [None], score=False)[0].cached_tokens > 0  # the base model's own KV is kept too
        engine.update_adapter("a", engine_tensors(folders["c"]), version=1)
        assert scored(engine, ["a"], score=False)[0].cached_tokens == 0  # an update starts a new namespace
    finally:
        engine.shutdown()
        fresh.shutdown()


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and max(abs(x - y) for x, y in zip(got, want)) <= 1e-5


def engine_tensors(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def test_noria_serve_loads_and_serves_adapters(tiny_model_dir, folders, tmp_path):
    proc = ServeProcess(tiny_model_dir, "--engine.block_size", "4", log_dir=tmp_path)
    try:
        proc.wait_ready()
        with httpx.Client(base_url=proc.url, timeout=60) as http:
            r = http.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(folders["a"])})
            assert r.status_code == 200 and r.json()["version"] == 0, r.text
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
            base = http.post("/generate", json=body).json()
            with_a = http.post("/generate", json={**body, "lora_path": "a"}).json()
            assert with_a["meta_info"]["adapter"] == "a" and with_a["meta_info"]["adapter_version"] == 0
            assert with_a["meta_info"]["output_token_logprobs"] != base["meta_info"]["output_token_logprobs"]
            r = http.post("/generate", json={**body, "lora_path": "zzz"})
            assert r.status_code == 400 and "zzz" in r.text
            models = [m["id"] for m in http.get("/v1/models").json()["data"]]
            assert "a" in models
            comp = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0}
            via_openai = http.post("/v1/completions", json={**comp, "model": "a"}).json()
            lps = via_openai["choices"][0]["logprobs"]["token_logprobs"]
            want = [lp for lp, _, _ in with_a["meta_info"]["output_token_logprobs"]]
            assert max(abs(x - y) for x, y in zip(lps, want)) < 1e-5
            r = http.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(folders["b"]), "load_inplace": True})
            assert r.json()["version"] == 1, r.text
            r = http.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
            assert r.status_code == 400 and "adapter_config.json" in r.text
            assert http.post("/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
            r = http.post("/generate", json={**body, "lora_path": "a"})
            assert r.status_code == 400 and "'a'" in r.text
    finally:
        proc.stop()


def test_every_lora_strategy_gives_the_same_rows(model, folders, monkeypatch):
    from noria.engine import lora_ops

    engine = make_engine(model, prefix_cache=False)
    try:
        engine.load_adapter("a", folders["a"])
        engine.load_adapter("b", folders["b"])
        mix = ["b", None, "a", "b"]
        want = scored(engine, mix)
        for strategy in lora_ops.STRATEGIES[1:]:
            monkeypatch.setattr(lora_ops, "STRATEGY", strategy)
            for out, ref in zip(scored(engine, mix), want):
                got, exp = out.input_logprobs + out.logprobs, ref.input_logprobs + ref.logprobs
                assert max(abs(x - y) for x, y in zip(got, exp)) <= 1e-5, strategy
    finally:
        engine.shutdown()


def test_a_load_past_the_memory_cap_is_refused(model, folders):
    engine = make_engine(model, lora_max_adapters=2, lora_max_memory_mb=0.01)
    try:
        with pytest.raises(AdapterError, match=r"cannot load adapter 'a': the LoRA slots would take .* over engine.lora_max_memory_mb"):
            engine.load_adapter("a", folders["a"])
        assert engine.adapters() == {} and engine.lora.nbytes == 0
    finally:
        engine.shutdown()
