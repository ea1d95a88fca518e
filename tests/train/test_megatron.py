"""The Megatron-Core backend on the CPU: its refusals, its config, and the HF <-> Megatron conversion
(names, shapes, the fused QKV / GLU layouts, the TP split, a real round trip through megatron-core's
GPTModel built on the CPU when megatron-core is installed). Forward and training run on a GPU
(tests/train/test_megatron_gpu.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_util import BIASED, DENSE, MOE, random_native
from noria.config import ConfigError, TrainConfig
from noria.models.megatron import ConversionError, expert_slice, expert_to_global, expert_to_local, tp_gather, tp_shard, to_hf, to_megatron
from noria.train import build_backend
from noria.train.megatron.model import MegatronUnavailable, megatron_installed
from repo_util import TESTS


def test_refused_where_it_cannot_run(monkeypatch):
    with pytest.raises(MegatronUnavailable, match="runs on CUDA only.*use train.backend single or fsdp2"):
        build_backend(TrainConfig(backend="megatron", device="cpu"))
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "megatron", None)  # as if megatron-core were not installed
        assert not megatron_installed()
        with pytest.raises(MegatronUnavailable, match=r"pip install 'noria\[megatron\]'"):
            build_backend(TrainConfig(backend="megatron", device="cuda"))
    if not torch.cuda.is_available() and megatron_installed():
        with pytest.raises(MegatronUnavailable, match="needs a CUDA GPU"):
            build_backend(TrainConfig(backend="megatron", device="cuda"))


def test_megatron_config_section():
    cfg = TrainConfig(backend="megatron", world_size=4)
    cfg.megatron.tp, cfg.megatron.ep = 2, 2
    cfg.validate()  # 2 data-parallel ranks, experts over both
    cfg.megatron.tp = 3
    with pytest.raises(ConfigError, match="not a multiple of train.megatron tp"):
        cfg.validate()
    cfg.megatron.tp, cfg.megatron.ep = 2, 4
    with pytest.raises(ConfigError, match="train.megatron.ep 4 does not divide the data-parallel size 2"):
        cfg.validate()
    cfg.megatron.ep, cfg.megatron.cp = 1, 0
    with pytest.raises(ConfigError, match="train.megatron.cp must be >= 1"):
        cfg.validate()
    cfg.megatron.cp = 1
    cfg.compile = True
    with pytest.raises(ConfigError, match="train.compile needs train.backend single or fsdp2"):
        cfg.validate()
    cfg.compile, cfg.lora.enabled = False, True
    with pytest.raises(ConfigError, match="train.lora.enabled needs train.backend single or fsdp2"):
        cfg.validate()


@pytest.mark.parametrize("config", [DENSE, MOE, BIASED], ids=["qwen2-tied-qkv-bias", "qwen3-moe-mixed", "llama-all-bias-mqa"])
def test_hf_megatron_names_shapes_and_round_trip(config):
    lm = random_native(config)
    args, state = lm.args, lm.state_dict()
    meg = to_megatron(state, args)
    hq, hkv, d, h = args.num_heads, args.num_kv_heads, args.head_dim, args.hidden_size
    qkv = meg["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((hq + 2 * hkv) * d, h)
    # Megatron's grouped layout: group g holds its query heads, then its key head, then its value head.
    per = hq // hkv
    q, k = state["model.layers.0.self_attn.q_proj.weight"], state["model.layers.0.self_attn.k_proj.weight"]
    g = hkv - 1
    start = g * (per + 2) * d
    assert torch.equal(qkv[start : start + d], q[g * per * d : (g * per + 1) * d])
    assert torch.equal(qkv[start + per * d : start + (per + 1) * d], k[g * d : (g + 1) * d])
    assert ("output_layer.weight" in meg) == (not args.tie_word_embeddings)
    if args.moe is not None:
        assert meg["decoder.layers.0.mlp.router.weight"].shape == (4, h)
        assert meg["decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"].shape == (2 * 32, h)
        assert meg["decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight"].shape == (h, 32)
        assert meg["decoder.layers.1.mlp.linear_fc1.weight"].shape == (2 * args.intermediate_size, h)  # dense layer
    back = list(to_hf(meg, args))
    expected = [n for n in state if not (args.tie_word_embeddings and n == "lm_head.weight")]
    assert [n for n, _ in back] == expected  # the native state-dict order: the sync stream's order
    for name, t in back:
        assert torch.equal(t, state[name]), name
    with pytest.raises(ConversionError, match="linear_proj.weight' is missing"):
        list(to_hf({k: v for k, v in meg.items() if "layers.1.self_attention.linear_proj.weight" not in k}, args))


def test_tensor_and_expert_parallel_split():
    lm = random_native(MOE)
    meg = to_megatron(lm.state_dict(), lm.args)
    for name, full in meg.items():
        parts = [tp_shard(name, full, 2, r) for r in range(2)]
        assert torch.equal(tp_gather(name, parts), full), name
    fc1 = meg["decoder.layers.1.mlp.linear_fc1.weight"]
    gate, up = fc1.chunk(2)
    assert torch.equal(tp_shard("decoder.layers.1.mlp.linear_fc1.weight", fc1, 2, 1), torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
    assert tp_shard("decoder.layers.0.mlp.router.weight", meg["decoder.layers.0.mlp.router.weight"], 2, 1).shape == (4, 64)
    assert tp_shard("decoder.layers.0.self_attention.linear_proj.weight", torch.zeros(64, 64), 2, 0).shape == (64, 32)
    assert expert_slice(4, 2, 1) == range(2, 4)
    name = "decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight"
    assert expert_to_local(name, range(2, 4)) == "decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight"
    assert expert_to_local(name, range(0, 2)) is None
    assert expert_to_global("decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight", 2) == name
    with pytest.raises(ConversionError, match="4 experts do not split over 3"):
        expert_slice(4, 3, 0)


GPT_ROUND_TRIP = textwrap.dedent(
    """
    import os, sys, warnings, json
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(1, 1)
    from noria.config import TrainConfig
    from noria.models.megatron import to_hf, to_megatron
    from noria.train.megatron.model import build_gpt, load_weights, quiet_import
    from megatron_util import DENSE, MOE, BIASED, random_native
    quiet_import()
    for config in (DENSE, MOE, BIASED):
        lm = random_native(config)
        args, state = lm.args, lm.state_dict()
        gpt = build_gpt(args, TrainConfig(), torch.float32, cpu=True)
        load_weights(gpt, to_megatron(state, args), args, experts=range(args.moe.num_experts) if args.moe else None)
        back = dict(to_hf(dict(gpt.named_parameters()), args))
        assert all(torch.equal(back[n], state[n]) for n in back), config["model_type"]
        assert len(back) == len(state) - (1 if args.tie_word_embeddings else 0)
        print(config["model_type"], "ok", sum(p.numel() for p in gpt.parameters()))
    dist.destroy_process_group()
    """
)


@pytest.mark.skipif(not megatron_installed(), reason="megatron-core is not installed (pip install 'noria[megatron]')")
def test_round_trip_through_a_real_gptmodel(tmp_path):
    """HF weights -> megatron-core's GPTModel (local spec, built on the CPU; every parameter must be
    filled with its exact shape) -> HF weights, bit for bit. In a child process: it owns a gloo group."""
    import os

    from noria.net import free_port

    tests = str(TESTS)
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)  # keep a wheel dir on the path
    out = subprocess.run([sys.executable, "-c", GPT_ROUND_TRIP, str(free_port())], capture_output=True, text=True,
                         timeout=120, cwd=tests, env={**os.environ, "PYTHONPATH": path})
    assert out.returncode == 0, out.stderr[-3000:]
    assert [line.split()[:2] for line in out.stdout.splitlines()] == [["qwen2", "ok"], ["qwen3_moe", "ok"], ["llama", "ok"]]
