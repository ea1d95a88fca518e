"""Scalar reward models (reward.model.kind scalar) and the judge on the rollout engines (engine shared).

A tiny sequence-classification model built from the tiny Llama config (random head) is served by a
real `noria serve` started by the run's own machinery: its /classify scores equal transformers'
forward of the same folder, concurrent rows share forwards, and a server that died fails the
samples as unreachable. The same folder loaded in process gives the same scores. The engine's
waiting queue admits higher priorities first; a shared judge's requests reach the in-process engine.
"""

from __future__ import annotations

import asyncio
import math
import re

import httpx
import pytest
import torch

from noria.config import RunConfig, load
from noria.config.reward import RewardModelConfig
from noria.engine.protocol import RequestError
from noria.errors import NoriaError
from noria.rewards.model import model_reward, start_judge, unbind_judge
from noria.rewards.runner import score_async
from noria.rewards.scalar import rm_input_ids
from noria.types import Sample, Status

PROMPTS = ["What is 1 + 2?", [{"role": "user", "content": "What is 3 + 4?"}], "What is 5 + 5?"]
RESPONSES = ["The answer is 3.", "7", "It is 11, I think, or maybe 10. The answer is 10."]


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    """A Bradley-Terry-shaped reward model: the tiny Llama with a random one-logit head, and its tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    folder = tmp_path_factory.mktemp("tiny-rm")
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.num_labels, config.pad_token_id = 1, 0
    torch.manual_seed(1)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 2.0)  # a head that spreads the scores
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return folder


def reference_logits(folder, prompts, responses) -> list[float]:
    """transformers' forward of the folder, one unpadded row at a time."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.inference_mode():
        return [float(model(torch.tensor([rm_input_ids(tok, p, r)])).logits[0, 0]) for p, r in zip(prompts, responses)]


def rm_config(rm_dir, tiny_model_dir, *extra: str) -> RunConfig:
    return load(RunConfig, None, [
        "--model.path", str(tiny_model_dir), "--model.dtype", "float32", "--data.task", "arithmetic",
        "--reward.model.kind", "scalar", "--reward.model.name", "rm", "--reward.model.engine", str(rm_dir),
        "--reward.model.retries", "0", "--reward.rule_weight", "0", "--reward.name", "exact_match", *extra,
    ])  # fmt: skip


def samples_of(responses) -> list[Sample]:
    return [Sample(prompt_ids=[1], response_text=r, status=Status.COMPLETED, group_id=0, index=i) for i, r in enumerate(responses)]


def engine_metrics(url: str, headers: dict) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^noria_engine_(\w+) ([-\d.e+]+)$", text, re.MULTILINE)}


def test_served_reward_model_equals_transformers_batches_and_dies(rm_dir, tiny_model_dir, tmp_path):
    expected = reference_logits(rm_dir, PROMPTS, RESPONSES)
    assert max(expected) - min(expected) > 0.05  # distinct scores: the comparison below can tell rows apart
    config = rm_config(rm_dir, tiny_model_dir, "--reward.model.cache", "false")  # every row asked, repeats too
    (child,) = start_judge(config, tmp_path)
    try:
        scorer = model_reward(config.reward.model)
        url, headers = scorer.client.url, scorer.client.headers
        n = 4  # each row several times, every request sent at once: the server batches them
        prompts, responses = PROMPTS * n, RESPONSES * n
        samples = samples_of(responses)
        counts = asyncio.run(score_async(samples, config.reward, ["3"] * len(samples), prompts=prompts))
        assert counts.scored == len(samples) and counts.n_failed == 0
        got = [s.metadata["rewards"]["rm"] for s in samples]
        assert got == pytest.approx(expected * n, abs=1e-4)
        assert [s.reward for s in samples] == got  # rule at weight 0: measured, not trained on
        assert len(counts.model_latencies) == len(samples)
        metrics = engine_metrics(url, headers)
        assert metrics["classify_rows"] == len(samples) and 0 < metrics["classify_forwards"] < len(samples)
        # SGLang's shape, straight: a batch of texts answers a list, each with the logit and the echoed id
        body = httpx.post(f"{url}/classify", json={"text": ["a b", "c"], "rid": ["x", "y"]}, headers=headers, timeout=30).json()
        assert [b["meta_info"]["id"] for b in body] == ["x", "y"] and all(len(b["embedding"]) == 1 for b in body)
        refused = httpx.post(f"{url}/generate", json={"input_ids": [5]}, headers=headers, timeout=30)
        assert refused.status_code == 400 and "/classify" in refused.json()["error"]["message"]
        child.kill()
        dead = samples_of(["1", "2"])
        counts = asyncio.run(score_async(dead, config.reward, ["3"] * 2, prompts=PROMPTS[:2]))
        assert counts.failed["unreachable"] == 2 and "reward model 'rm' at" in dead[0].status_reason
    finally:
        child.stop()
        unbind_judge("rm")


def test_in_process_reward_model_and_sigmoid(rm_dir, tiny_model_dir, tmp_path):
    expected = reference_logits(rm_dir, PROMPTS, RESPONSES)
    config = rm_config(rm_dir, tiny_model_dir, "--reward.model.in_process", "true", "--reward.model.scale", "sigmoid")
    try:
        assert start_judge(config, tmp_path) == []  # nothing to stop: the model lives here
        samples = samples_of(RESPONSES)
        counts = asyncio.run(score_async(samples, config.reward, ["3"] * 3, prompts=PROMPTS))
        assert counts.scored == 3
        assert [s.reward for s in samples] == pytest.approx([1 / (1 + math.exp(-x)) for x in expected], abs=1e-5)
    finally:
        unbind_judge("rm")


def test_scalar_config_checks_name_the_key():
    with pytest.raises(NoriaError, match="engine shared is for kind judge"):
        RewardModelConfig(kind="scalar", engine="shared").validate()
    with pytest.raises(NoriaError, match="in_process needs kind scalar"):
        RewardModelConfig(kind="judge", engine="x", in_process=True).validate()


# ------------------------------------------------------------------------------ sharing the engines


def test_waiting_queue_admits_higher_priority_first_and_retracts_lowest():
    from noria.config import EngineConfig
    from noria.engine.kv_cache import KVCache
    from noria.engine.protocol import GenerateRequest, SamplingParams
    from noria.engine.radix import RadixCache
    from noria.engine.scheduler import Req, Scheduler, StopChecker

    config = EngineConfig(kv_cache_tokens=64, block_size=4, chunked_prefill_size=8, max_batch_tokens=64, max_running_requests=2)
    kv = KVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=16, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    sched = Scheduler(config, kv, RadixCache(kv.allocator, 4, enabled=False), StopChecker(set(), None))
    reqs = {}
    for name, priority in [("judge1", -1), ("roll1", 0), ("judge2", -1), ("roll2", 0), ("urgent", 1)]:
        request = GenerateRequest(input_ids=[3, 4, 5], sampling=SamplingParams(max_new_tokens=4), rid=name, priority=priority)
        reqs[name] = Req(request, lambda o: None, False, max_total_tokens=7)
        sched.add(reqs[name])
    assert [r.rid for r in sched.waiting] == ["urgent", "roll1", "roll2", "judge1", "judge2"]
    assert [c.req.rid for c in sched.schedule()] == ["urgent", "roll1"]
    sched._retract(reqs["roll1"])  # back at the front of its priority, never ahead of a higher one
    assert [r.rid for r in sched.waiting] == ["roll1", "roll2", "judge1", "judge2"]


def test_shared_judge_goes_to_the_rollout_engine_below_rollout(tiny_model_dir, tmp_path):
    from noria.config import EngineConfig
    from noria.engine import Engine
    from noria.models import load_tokenizer
    from noria.rollout.client import LocalEngineClient

    engine = Engine.from_path(str(tiny_model_dir), EngineConfig(kv_cache_tokens=2048), dtype="float32")
    seen: list[int] = []
    submit = engine.submit

    def spy(req, *args, **kwargs):
        seen.append(req.priority)
        return submit(req, *args, **kwargs)

    engine.submit = spy
    config = load(RunConfig, None, [
        "--model.path", str(tiny_model_dir), "--data.task", "arithmetic", "--reward.model.kind", "judge",
        "--reward.model.engine", "shared", "--reward.model.max_new_tokens", "6", "--reward.model.retries", "0",
    ])  # fmt: skip
    try:
        with pytest.raises(NoriaError, match="engine shared: the judge needs the run's rollout engines"):
            start_judge(config, tmp_path)
        assert start_judge(config, tmp_path, LocalEngineClient(engine), load_tokenizer(tiny_model_dir)) == []
        samples = samples_of(["3", "4", "5"])
        counts = asyncio.run(score_async(samples, config.reward, ["3"] * 3, prompts=["What is 1 + 2?"] * 3))
        # the random tiny policy rarely writes a score: each sample is scored or unparseable, never otherwise
        assert counts.scored + counts.failed["unparseable"] == 3 and seen == [-1, -1, -1]
        assert model_reward(config.reward.model).client.requests == 3
    finally:
        unbind_judge("judge")
        engine.shutdown(1)


def test_classify_route_refuses_bad_rows():
    from noria.engine.server.classify_api import ClassifyApi

    class Fake:
        tokenizer, vocab_size = None, 10

    with pytest.raises(RequestError, match="exactly one of text or input_ids"):
        ClassifyApi.rows({}, Fake())
    with pytest.raises(RequestError, match=r"input_ids\[1\]\[0\] = 12 is outside the vocabulary"):
        ClassifyApi.rows({"input_ids": [[1], [12]]}, Fake())
    with pytest.raises(RequestError, match="no tokenizer"):
        ClassifyApi.rows({"text": "hi"}, Fake())


def test_generate_route_reads_sglang_priority():
    from types import SimpleNamespace

    from noria.engine.server.native_api import NativeApi

    api = NativeApi(SimpleNamespace(engine=SimpleNamespace(vocab_size=100, max_context=512, tokenizer=None)))
    reqs, batched = api.parse_generate({"input_ids": [[1, 2], [3]], "priority": -1})
    assert batched and [r.priority for r in reqs] == [-1, -1]
    assert api.parse_generate({"input_ids": [1, 2]})[0][0].priority == 0
    with pytest.raises(RequestError, match="priority has the wrong type"):
        api.parse_generate({"input_ids": [1], "priority": "low"})
