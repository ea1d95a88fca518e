"""RL on an architecture with no native model (GPT-NeoX, GPT-2) through the generic transformers path:
``model.impl: hf`` (and ``auto`` for these families) runs the rollout on ``noria.engine.HFEngine`` and trains
transformers' model, with weight sync between them (CPU, random-init tiny models, a BPE tokenizer built here).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from noria.cli import main
from rl_util import read_jsonl, rl_args
from tiny_util import build_tokenizer


def _build(arch: str, folder: Path) -> Path:
    from transformers import AutoModelForCausalLM, GenerationConfig, GPT2Config, GPTNeoXConfig

    tok = build_tokenizer(folder)
    ids = {"vocab_size": len(tok), "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    if arch == "gpt2":
        config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, pad_token_id=tok.pad_token_id, **ids)
    else:
        config = GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                               max_position_embeddings=256, pad_token_id=tok.pad_token_id, **ids)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(**{k: v for k, v in ids.items() if k != "vocab_size"})
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(("arch", "impl"), [("gpt_neox", "hf"), ("gpt2", "auto")])
def test_rl_runs_end_to_end_on_the_generic_path(arch, impl, tmp_path, capsys):
    model = _build(arch, tmp_path / arch)
    run = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text("name: rl-hf\n")
    extra = {"model.impl": impl, "model.dtype": "float32", "train.max_steps": 3, "rollout.prompts_per_step": 2,
             "rollout.n_samples": 4, "eval.every": 3, "eval.limit": 4}  # fmt: skip
    assert main(["train", str(config), *rl_args(model, **extra), "--run-dir", str(run), "--no-progress"]) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["version"] for r in rows] == [1, 2, 3]
    # rollout logprobs (the engine's) agree with the trainer's recomputation of them, not bitwise
    assert all(r["rollout_logprob_abs_diff_max"] < 1e-3 for r in rows), [r["rollout_logprob_abs_diff_max"] for r in rows]
    evals = read_jsonl(run / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 3] and all("accuracy" in e for e in evals)
    assert (run / "final" / "config.json").is_file()


def test_the_generic_engine_takes_weight_updates_and_tags_tokens(tmp_path):
    from noria.config import EngineConfig
    from noria.engine import GenerateRequest, HFEngine, SamplingParams, in_process_engine

    folder = _build("gpt_neox", tmp_path / "neox")
    engine = in_process_engine(folder, EngineConfig(), "auto", "float32", "cpu", 0)
    assert isinstance(engine, HFEngine)

    def ask(seed):
        req = GenerateRequest(input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=6, temperature=1.0, seed=seed, ignore_eos=True))
        return asyncio.run(engine.generate(req))

    try:
        first, again = ask(3), ask(3)
        assert first.output_ids == again.output_ids and len(first.output_ids) == 6  # a seed fixes the tokens
        assert first.weight_versions == [0] * 6 and all(lp <= 0 for lp in first.logprobs)
        name = next(n for n in engine.weights.specs() if n.split(".")[0] in ("lm_head", "embed_out"))  # by version
        new = {name: torch.zeros_like(engine.weights.stage_area.tensor(name))}
        engine.weights.update_from_state_dict(new, version=1)
        after = ask(3)
        assert after.weight_versions == [1] * 6
        assert all(abs(lp - (-torch.log(torch.tensor(float(engine.model.hf.config.vocab_size)))).item()) < 1e-5 for lp in after.logprobs)
    finally:
        engine.shutdown()
