"""Image RL on the one loop, end to end through ``noria train``: colocated and disaggregated
(asynchronous) engines, Flow-GRPO and DiffusionNFT, LoRA with adapter-only sync, the run folder's
files and report, bitwise resume after SIGKILL, and (slow) a DiT that learns to draw the digit it
is asked for."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from diffusion_util import write_dit
from repo_util import ROOT, TESTS

BASE = {
    "data": {"task": "digits", "task_args": {"prompts_per_class": 2}},
    "reward": {"name": "noria.diffusion.rewards:digit_classifier"},
    "rollout": {"n_samples": 4, "prompts_per_step": 3},
    "engine": {"deterministic": True},
    "train": {"max_steps": 3, "optim": {"lr": 1.0e-4}},
    "eval": {"every": 2, "n_samples": 2, "limit": 3},
    "diffusion": {"steps": 4, "eval_steps": 4, "eval_reward": "noria.diffusion.rewards:digit_correct"},
}


def merge(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        out[key] = merge(base.get(key, {}), value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def write_config(tmp_path: Path, model: Path, **changes) -> Path:
    config = merge({**BASE, "name": "images", "model": {"path": str(model)}}, changes)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def train(config: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "noria", "train", str(config), "--no-progress", *args]
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{ROOT}"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def dit(tmp_path_factory):
    return write_dit(tmp_path_factory.mktemp("dit") / "model")


def test_flow_grpo_colocated_run_writes_a_whole_run_folder(dit, tmp_path):
    from diffusers import DiTTransformer2DModel

    from noria.runview.report import write_report

    run = tmp_path / "run"
    done = train(write_config(tmp_path, dit), "--run-dir", str(run))
    assert done.returncode == 0, done.stderr[-3000:]
    steps = rows(run / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2, 3] and [r["version"] for r in steps] == [1, 2, 3]
    assert all(r["rollout_logprob_abs_diff_max"] == 0.0 for r in steps)  # engine == trainer, bit for bit
    assert all(r["rollout/response_len_mean"] == 4 and r["train/pairs"] == 12 * 4 for r in steps)
    evals = rows(run / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 3] and all(0 <= e["accuracy"] <= 1 for e in evals)
    assert all(0 < e["diversity"] < 1 for e in evals)  # two seeds of one class give two different images
    assert all((run / "eval" / f"step-{e['step']:06d}.png").is_file() for e in evals)
    trajectory = rows(run / "rollouts" / "step-000001.jsonl")[0]
    assert trajectory["token_ids"] == [0, 1, 2, 3] and len(trajectory["logprobs"]) == 4
    DiTTransformer2DModel.from_pretrained(run / "final")
    page = write_report(run)
    assert (page.parent / "samples_first.png").is_file() and (page.parent / "samples_last.png").is_file()


def test_diffusion_nft_with_lora_adapter_sync(dit, tmp_path):
    lora = {"enabled": True, "sync": "adapter", "rank": 4, "target_modules": ["to_q", "to_v", "ff.net.2"]}
    config = write_config(
        tmp_path, dit, train={"max_steps": 2, "lora": lora, "optim": {"lr": 1.0e-3}},
        diffusion={"objective": "diffusion_nft", "noise_level": 0.0}, eval={"every": 0},
    )  # fmt: skip
    done = train(config, "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-3000:]
    steps = rows(tmp_path / "run" / "metrics.jsonl")
    assert all(0 < r["nft/optimality_mean"] < 1 and r["sync/bytes"] < 60_000 for r in steps), steps  # adapters only


def test_disaggregated_asynchronous_image_rl(dit, tmp_path):
    config = write_config(
        tmp_path, dit, rollout={"placement": "disaggregated", "max_staleness": 1},
        train={"max_steps": 4, "loss": {"off_policy": "tis"}}, eval={"every": 0},
    )  # fmt: skip
    done = train(config, "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-3000:]
    steps = rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["version"] for r in steps] == [1, 2, 3, 4]
    assert max(r["buffer/staleness_max"] for r in steps) <= 1
    assert all(r["sync/bytes"] > 0 for r in steps)


@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_sigkill_then_resume_is_bitwise_identical(dit, tmp_path):
    """Killed after its step-2 checkpoint; resumed, it ends with the metrics and weights of an
    uninterrupted run."""
    import torch
    from safetensors.torch import load_file

    changes = {"train": {"max_steps": 4, "save_every": 1}, "eval": {"every": 0}}
    straight = tmp_path / "straight"
    straight.mkdir()
    done = train(write_config(straight, dit, **changes), "--run-dir", str(straight / "run"))
    assert done.returncode == 0, done.stderr[-3000:]
    killed = tmp_path / "killed"
    killed.mkdir()
    config = write_config(killed, dit, **changes)
    cmd = [sys.executable, "-m", "noria", "train", str(config), "--no-progress", "--run-dir", str(killed / "run")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 300
    while not (killed / "run" / "checkpoints" / "step-000002" / "COMMITTED").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its step-2 checkpoint"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = train(config, "--resume", str(killed / "run"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = rows(straight / "run" / "metrics.jsonl"), rows(killed / "run" / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for key in ("loss", "rollout/reward_mean", "grad_norm", "clip_frac"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    wa = load_file(straight / "run" / "final" / "diffusion_pytorch_model.safetensors")
    wb = load_file(killed / "run" / "final" / "diffusion_pytorch_model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_image_diversity_is_zero_for_copies_and_the_rms_pixel_distance_otherwise():
    import numpy as np

    from noria.diffusion.evaluate import image_diversity

    black, white = np.zeros((8, 8, 1), np.uint8), np.full((8, 8, 1), 255, np.uint8)
    half = black.copy()
    half[:4] = 255
    assert image_diversity([[black, black, black], [white, white]]) == 0.0
    assert image_diversity([[black, white]]) == pytest.approx(1.0)
    assert image_diversity([[black, half], [white]]) == pytest.approx(np.sqrt(0.5))  # a lone image is left out
    assert np.isnan(image_diversity([[black]]))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_flow_grpo_raises_the_classifier_reward_of_a_digits_dit(tmp_path):
    """The shipped recipes on a small budget: half of examples/sft_dit_digits.yaml's flow-matching
    SFT, then 8 steps of examples/flow_grpo_digits.yaml at a higher learning rate; the reward's
    mean over the held-out evaluation images (100 fixed seeds, ODE) rises from before RL to after."""
    sft, grpo = tmp_path / "sft", tmp_path / "grpo"
    model = ROOT / "examples" / "models" / "dit-digits"
    done = train(ROOT / "examples" / "sft_dit_digits.yaml", "--run-dir", str(sft), "--model.path", str(model), "--train.max_steps", "120")
    assert done.returncode == 0, done.stderr[-3000:]
    done = train(
        ROOT / "examples" / "flow_grpo_digits.yaml", "--run-dir", str(grpo), "--model.path", str(sft / "final"),
        "--train.max_steps", "8", "--eval.every", "8", "--eval.n_samples", "10", "--train.optim.lr", "3.0e-4",
        "--train.loss.kl_coef", "0.0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = rows(grpo / "eval.jsonl")
    assert (before["step"], after["step"]) == (0, 8)
    assert after["reward_mean"] > before["reward_mean"] + 0.01, (before, after)
    assert all(r["train/pairs"] == 40 * 10 for r in rows(grpo / "metrics.jsonl"))  # 2 optimizer steps of 40 images x 10 steps
