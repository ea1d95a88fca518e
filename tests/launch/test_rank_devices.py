"""Where the local trainer ranks of ``train.world_size`` > 1 run: one GPU each, from ``train.device``
on (``cuda`` or ``cuda:K``: rank r on cuda:K+r), and a clear refusal, before any rank process
starts, where the machine has too few GPUs. CPU-only machine: the GPU mapping itself ran nowhere
here (no machine of several GPUs was lent); the refusal is what a CPU machine can show."""

from __future__ import annotations

import pytest

from noria.config import load_config
from noria.errors import NoriaError
from noria.launch.ranks import ProcessRanks, local_rank_device


def test_cpu_ranks_share_the_cpu():
    assert [local_rank_device("cpu", r, 2) for r in range(2)] == ["cpu", "cpu"]


def test_ranks_on_more_gpus_than_the_machine_has_are_refused_before_any_rank_starts(tiny_model_dir, tmp_path):
    import torch

    n = torch.cuda.device_count()
    config = load_config(None, [
        "--model.path", str(tiny_model_dir), "--data.task", "arithmetic", "--train.backend", "fsdp2",
        "--train.world_size", str(n + 1), "--train.device", "cuda",
    ])  # fmt: skip
    with pytest.raises(NoriaError) as e:
        ProcessRanks(config, tmp_path)
    said = str(e.value)
    assert f"train.world_size={n + 1}" in said and f"cuda:{n}" in said and f"has {n} CUDA GPU(s)" in said, said
