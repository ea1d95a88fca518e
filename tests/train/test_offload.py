"""``train.offload_optimizer``: the optimizer state in host memory while a colocated engine generates.

On CUDA (skipped without a GPU): the state's GPU memory is freed while it is away and comes back bit
for bit, and a colocated RL run moves it out between its steps. Anywhere: the
settings it cannot work with are refused at start, naming the keys."""

from __future__ import annotations

import pytest
import torch

from noria.config import ConfigError, load_config
from rl_util import read_jsonl, rl_args

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(("extra", "named"), [
    ({"train.device": "cpu", "rollout.placement": "colocated"}, "train.device"),
    ({"train.device": "cpu", "rollout.placement": "disaggregated"}, "rollout.placement"),
])  # fmt: skip
def test_offload_is_refused_where_it_cannot_free_gpu_memory(tiny_model_dir, tmp_path, extra, named):
    from noria.launch.rl import run_rl

    config = load_config(None, rl_args(tiny_model_dir, **{"train.offload_optimizer": True, **extra}))
    with pytest.raises(ConfigError, match=f"train.offload_optimizer.*{named}"):
        run_rl(config, str(tmp_path / "run"), None, False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@cuda
def test_offloaded_state_leaves_the_gpu_and_comes_back_bit_for_bit():
    from noria.train.offload import OptimizerOffload

    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 1024, device="cuda")).square().mean().backward()
    optimizer.step()
    before = {k: v.clone() for k, v in optimizer.state[model.weight].items()}
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    mover = OptimizerOffload(optimizer, "cuda")
    moved = mover.offload()
    torch.cuda.synchronize()
    assert moved == 2 * 4 * (1024 * 1024 + 1024)  # two fp32 moments of the weight and the bias
    assert allocated - torch.cuda.memory_allocated() >= moved
    assert optimizer.state[model.weight]["exp_avg"].device.type == "cpu"
    assert mover.reload() == moved and mover.reload() == 0
    after = optimizer.state[model.weight]
    assert all(torch.equal(before[k], after[k]) and after[k].device == before[k].device for k in before)
    assert mover.metrics()["memory/optimizer_offloaded_gb"] == pytest.approx(moved / 1e9)


@cuda
def test_a_colocated_run_offloads_two_moments_a_parameter_between_steps(tiny_model_dir, tmp_path):
    """Run-level: the moments leave the GPU after every step from the first on (the size counted is
    Adam's two fp32 moments per parameter) and the run trains. Not compared with a run without offload:
    two CUDA runs of this config differ from the second step on anyway (the trainer's CUDA kernels are
    not deterministic); the copies themselves are checked bit for bit above."""
    from transformers import AutoModelForCausalLM

    from noria.launch.rl import run_rl

    args = rl_args(tiny_model_dir, **{"train.device": "cuda", "model.device": "cuda", "rollout.placement": "colocated",
                                      "train.max_steps": 3, "train.offload_optimizer": True})  # fmt: skip
    run_rl(load_config(None, args), str(tmp_path / "run"), None, False)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert [r["memory/optimizer_offloaded_gb"] for r in rows] == [0.0] + [pytest.approx(8 * params / 1e9)] * 2
    assert all(r["time/optimizer_offload_s"] >= 0 and r["loss"] == r["loss"] for r in rows)
