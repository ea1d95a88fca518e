"""``noria bench gpu-rl`` on the CPU (its ``--device cpu`` path, tiny model): the real job runs, the
figures come from its metrics and add up. CPU only, about 20 s (the GPU run is scripts/gpu.sh rl)."""

from __future__ import annotations

import json

import pytest

from noria.bench import gpu_rl


def test_tokenizer_fills_the_vocab_with_decodable_pieces(tmp_path):
    tok = gpu_rl.build_tokenizer(tmp_path, 1024)
    assert len(tok) == 1024
    bpe = 512  # the trained part; every id above decodes to " <hex>"
    pieces = [tok.decode([i]) for i in range(bpe, 1024)]
    assert all(p.startswith(" ") and len(p) > 1 for p in pieces) and len(set(pieces)) == len(pieces)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True, tokenize=False)
    ids = tok(text).input_ids
    assert tok.decode(ids) == text
    assert max(ids) < bpe  # fillers have no merges: text never encodes to them
    with pytest.raises(ValueError, match="smaller than the trained BPE"):
        gpu_rl.build_tokenizer(tmp_path / "small", 100)


def test_digit_share_and_settings():
    assert gpu_rl.digit_share("", None, {}) == 0.0
    assert gpu_rl.digit_share(" 1a 22", None, {}) == pytest.approx(0.5)
    assert gpu_rl.settings("8,64", "8", "32,256") == [(8, 8, 32), (64, 8, 256)]
    with pytest.raises(ValueError):
        gpu_rl.settings("8,64", "8,8,8", "32")


def test_bench_runs_the_main_job_and_splits_its_steps(tmp_path, monkeypatch):
    from noria.cli import main

    monkeypatch.setenv("NORIA_NO_CPU_KERNEL", "1")  # torch sampler: no C++ build inside the test's time
    out = tmp_path / "out.json"
    argv = ["bench", "gpu-rl", "--model", "tiny", "--device", "cpu", "--steps", "1", "--prompts", "2", "--samples", "4",
            "--new-tokens", "8", "--vocab", "1024", "--set", "engine.attention=torch", "--work-dir", str(tmp_path),
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0

    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "gpu-rl"
    head, *rest = doc["results"]
    rows = [json.loads(line) for line in (tmp_path / "run-2x4x8" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and head["measured_steps"] == 1 and head["steps_s"] == pytest.approx([r["seconds"] for r in rows], abs=1e-4)
    assert head["metric"] == "step_s" and head["noria"] == pytest.approx(rows[1]["seconds"], abs=1e-4)  # warm-up left out
    # Stages: the job's own timers, disjoint parts of the step; reward scoring is timed inside the rollout.
    stages, shares = head["stages_s"], head["shares"]
    assert stages["train"] == pytest.approx(rows[1]["time/train_s"], abs=1e-4)
    assert stages["sync"] == pytest.approx(rows[1]["sync/seconds"], abs=1e-4)
    assert all(v is None or v >= 0 for v in stages.values())
    assert sum(v for v in shares.values() if v is not None) == pytest.approx(1.0, abs=1e-3)
    assert shares["rollout"] > 0 and shares["train"] > 0 and shares["sync"] > 0
    assert head["reward_scoring_s"] == pytest.approx(rows[1]["time/reward_s"], abs=1e-4) and head["reward_scoring_s"] > 0
    # The trainer really trained every step: the reward varies within groups, no group was dropped.
    assert head["optimizer_steps"] == 2 and head["skipped_steps"] == 0 and head["groups_trained"] == 2
    assert all(r["train/samples"] == 8 and r["loss_tokens"] > 0 and r["rollout/groups_zero_variance_frac"] == 0 for r in rows)
    assert all(r["grad_norm"] > 0 for r in rows) and head["grad_norm_mean"] == pytest.approx(rows[1]["grad_norm"], rel=1e-3)
    figures = {r["metric"]: r["noria"] for r in rest}
    assert 0 < figures["generated_tokens_per_step"] <= 2 * 4 * 8
    assert figures["trained_tokens_per_step"] > figures["generated_tokens_per_step"]  # prompts are in it too
    assert figures["rollout_tokens_per_s"] > 0 and figures["trainer_tokens_per_s"] > 0
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["vocab_size"] == 1024 and config["num_hidden_layers"] == 2
