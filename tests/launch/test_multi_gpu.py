"""Multi-GPU plumbing on the CPU (issue 10): where the disaggregated engine runs, which broadcast
backend the RL job picks, NVLink multicast off in every process, and ``noria bench gpu-multi
--layout cpu`` (the multi-GPU benchmark's code on gloo with a tiny model). No GPU needed; the CUDA
runs are in ``test_multi_gpu_cuda.py``. About 75 s on 2 cores (the two bench runs: 25 s and 35 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from noria.config import ConfigError, load_config
from noria.process.env import MULTICAST_OFF
from noria.engine.child import engine_device, start_engine_server
from noria.launch.parts import build_weight_sync
from repo_util import ROOT
from rl_util import rl_args


def disaggregated(model, **extra):
    return load_config(None, rl_args(model, **{"rollout.placement": "disaggregated", **extra}))


def without_multicast_vars() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in MULTICAST_OFF}


def test_engine_device_option(tiny_model_dir):
    cfg = disaggregated(tiny_model_dir, **{"rollout.engine_device": "cuda:0", "train.device": "cuda:1"})
    assert engine_device(cfg) == "cuda:0" and cfg.train.device == "cuda:1"
    assert engine_device(disaggregated(tiny_model_dir, **{"model.device": "cuda:1"})) == "cuda:1"  # null: model.device
    with pytest.raises(ConfigError, match="rollout.engine_device places the `noria serve` engine"):
        load_config(None, rl_args(tiny_model_dir, **{"rollout.engine_device": "cpu"}))  # colocated
    with pytest.raises(ConfigError, match="cpu, cuda or cuda:N, got 'gpu:1'"):
        disaggregated(tiny_model_dir, **{"rollout.engine_device": "gpu:1"})
    with pytest.raises(ConfigError, match="no rollout.engine_url"):
        disaggregated(tiny_model_dir, **{"rollout.engine_device": "cpu", "rollout.engine_url": "http://127.0.0.1:1"})


@pytest.mark.parametrize(
    ("engine", "trainer", "wanted", "expected"),
    [("cuda:0", "cuda:1", "auto", "auto"), ("cuda", "cuda:0", "auto", "gloo"), ("cuda:1", "cuda:1", "nccl", "nccl"), ("cpu", "cpu", "auto", "auto")],
)
def test_broadcast_backend_of_the_job(tiny_model_dir, tmp_path, engine, trainer, wanted, expected):
    """auto stays auto (NCCL for CUDA weights) unless engine and trainer share one GPU: gloo then."""
    cfg = disaggregated(tiny_model_dir, **{"rollout.engine_device": engine, "train.device": trainer,
                                           "sync.transport": "broadcast", "sync.broadcast_backend": wanted})  # fmt: skip
    sync = build_weight_sync(cfg, "http://127.0.0.1:9", tmp_path)  # no group is made before the first push
    try:
        assert sync.transport_impl.wanted == expected
        if expected == "auto":
            assert sync.transport_impl._backend_for(torch.device(trainer)) == ("nccl" if trainer.startswith("cuda") else "gloo")
    finally:
        sync.close()


def test_nccl_with_cpu_weights_is_refused(tiny_model_dir, tmp_path):
    from noria.sync import WeightSyncError

    cfg = disaggregated(tiny_model_dir, **{"sync.transport": "broadcast", "sync.broadcast_backend": "nccl"})
    sync = build_weight_sync(cfg, "http://127.0.0.1:9", tmp_path)
    try:
        with pytest.raises(WeightSyncError, match="nccl needs the trainer's weights on CUDA, they are on cpu"):
            sync.transport_impl._backend_for(torch.device("cpu"))
    finally:
        sync.close()


def test_cli_entry_turns_multicast_off(monkeypatch, capsys):
    from noria.cli import main

    for key in MULTICAST_OFF:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # an exported value wins
    assert main(["config", "--reference"]) == 0
    assert os.environ["NCCL_NVLS_ENABLE"] == "1"
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and os.environ["NVSHMEM_DISABLE_NVLS"] == "1"


def test_noria_serve_child_gets_multicast_off_and_the_engine_device(tiny_model_dir, tmp_path, monkeypatch):
    """Even for a job built outside the CLI (nothing set in this process), the engine child has them."""
    for key in MULTICAST_OFF:
        monkeypatch.delenv(key, raising=False)
    cfg = disaggregated(tiny_model_dir, **{"rollout.engine_device": "cpu", "model.device": "meta"})
    process, url, _ = start_engine_server(Path(tiny_model_dir), cfg, tmp_path)  # would fail on model.device meta
    try:
        environ = dict(e.split("=", 1) for e in Path(f"/proc/{process.pid}/environ").read_text().split("\0") if "=" in e)
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_text().split("\0")
    finally:
        process.stop()
    assert {k: environ.get(k) for k in MULTICAST_OFF} == MULTICAST_OFF
    assert cmdline[cmdline.index("--device") + 1] == "cpu"
    assert all(k not in os.environ for k in MULTICAST_OFF)


def run_bench(tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "noria", "bench", "gpu-multi", "--layout", "cpu", "--work-dir", str(tmp_path / "work"), "--json", str(out), *args]
    done = subprocess.run(cmd, env=without_multicast_vars(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "gpu-multi" and doc["command"].startswith("noria bench gpu-multi --layout cpu")
    return doc["results"]


def test_bench_fsdp_two_gloo_ranks_against_one_process(tmp_path):
    rows = run_bench(tmp_path, "--parts", "fsdp", "--sequences", "4", "--min-len", "16", "--max-len", "48", "--steps", "2",
                     "--warmup", "1", "--micro-batch-tokens", "64", "--lr", "1e-3")  # fmt: skip
    by = {r["metric"]: r for r in rows}
    main = by["tokens_per_s"]
    assert main["world"] == 2 and main["noria"] > 0 and main["peers"]["one_device"] > 0
    assert main["multicast_off_env"] and all(e == MULTICAST_OFF for e in main["env_seen"])  # set by the CLI, inherited by both ranks
    sharded, single = main["losses"], main["losses_one_device"]
    assert len(sharded) == len(single) == 3
    assert sharded[-1] < sharded[0] - 1e-3  # the model trains: equal losses are not equal constants
    assert by["loss_max_rel_diff"]["noria"] == main["loss_max_rel_diff"] < 5e-3  # bf16 tolerance
    assert 0 < by["mfu"]["noria"] < 1 and by["step_s"]["noria"] > 0


def test_bench_rl_async_disaggregated_against_sync_colocated(tmp_path):
    rows = run_bench(tmp_path, "--parts", "rl", "--rl-steps", "3", "--prompts-per-step", "2", "--n-samples", "4",
                     "--max-new-tokens", "16", "--staleness", "1", "--rl-micro-batch-tokens", "1024")  # fmt: skip
    by = {r["metric"]: r for r in rows}
    tps = by["tokens_per_s"]
    assert tps["noria"] > 0 and tps["peers"]["sync_colocated"] > 0 and tps["steps"] == 2
    assert 0 <= tps["staleness_mean"] <= tps["staleness_max"] <= 1
    assert by["staleness_mean"]["peers"]["sync_colocated"] == 0
    sync = by["sync_gb_per_s"]
    with safe_open(tmp_path / "work" / "rl-tiny" / "model.safetensors", "pt") as f:
        model_bytes = sum(f.get_tensor(k).nbytes for k in f.keys())
    assert sync["sync_bytes"] == model_bytes  # every weight, once, in bf16
    assert sync["backend"] == "gloo" and sync["noria"] > 0 and sync["bound"] > 0 and sync["ratio_to_raw"] > 0
    async_cfg = (tmp_path / "work" / "rl-async" / "config.yaml").read_text()
    assert "placement: disaggregated" in async_cfg and "engine_device: cpu" in async_cfg and "transport: broadcast" in async_cfg


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the message of a host with fewer than 2 GPUs")
def test_bench_says_what_it_needs(capsys):
    from noria.cli import main

    with pytest.raises(SystemExit, match=r"--layout two-gpus needs 2 CUDA device\(s\), this host has \d.*--layout one-gpu"):
        main(["bench", "gpu-multi"])
