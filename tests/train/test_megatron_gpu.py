"""The Megatron-Core backend on a CUDA GPU against the PyTorch backend (``single``, bf16) on the same
batch: logprobs, five RL steps side by side, the HF round trip, the weight stream, checkpoints, and
the same for a small Qwen3-MoE. Skipped without a GPU or without megatron-core (``noria[megatron]``).

Figures print with ``-s`` (scripts/gpu.sh PARTS=megatron keeps them in its log)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from noria.config import TrainConfig
from noria.train import build_backend
from noria.train.megatron.model import megatron_installed
from noria.train.packing import pack_samples
from noria.types import Sample

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not megatron_installed(), reason="needs megatron-core (pip install 'noria[megatron]')"),
]

MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 4096, "hidden_size": 512,
       "intermediate_size": 1024, "moe_intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
       "num_key_value_heads": 4, "head_dim": 64, "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": True,
       "mlp_only_layers": [0], "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
       "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}  # fmt: skip


def model_folder(tmp_path_factory, name, config=None):
    from noria.bench.gpu_common import random_model
    from noria.models import save_model

    lm = random_model(config or name, device="cuda", dtype=torch.bfloat16, seed=1)
    folder = save_model(lm, tmp_path_factory.mktemp(name) / "model")  # HF layout (one tensor per expert)
    del lm
    torch.cuda.empty_cache()
    return folder


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return model_folder(tmp_path_factory, "qwen3-0.6b")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return model_folder(tmp_path_factory, "tiny-moe", MOE)


def rl_batch(vocab: int, n: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        p, r = int(torch.randint(16, 120, (1,), generator=g)), int(torch.randint(16, 200, (1,), generator=g))
        ids = torch.randint(0, vocab, (p + r,), generator=g).tolist()
        samples.append(Sample(prompt_ids=ids[:p], response_ids=ids[p:], loss_mask=[1] * r,
                              rollout_logprobs=(-torch.rand(r, generator=g) * 3 - 9).tolist(), index=i))
    return pack_samples(samples, torch.linspace(-1, 1, n).tolist())


def backend(folder, kind: str, param_dtype: str = "bfloat16", **fields):
    cfg = TrainConfig(backend=kind, device="cuda", param_dtype=param_dtype, micro_batch_tokens=1024, **fields)
    cfg.optim.lr = 1e-5
    cfg.loss.policy_loss, cfg.loss.aggregation = "ppo_clip", "token_mean"
    b = build_backend(cfg)
    b.init(folder)
    return b


def compare_logprobs(folder, vocab, batch=None):
    batch = batch if batch is not None else rl_batch(vocab)
    meg, ref = backend(folder, "megatron"), backend(folder, "single")
    a, e = meg.compute_logprobs(batch, with_entropy=True), ref.compute_logprobs(batch, with_entropy=True)
    mask = batch.loss_mask > 0
    diff = (a.logprobs - e.logprobs)[mask].abs()
    print(f"\nlogprobs megatron vs fsdp ({mask.sum()} tokens): mean |diff| {diff.mean():.2e}, max {diff.max():.2e}; "
          f"mean logprob {a.logprobs[mask].mean():.4f} vs {e.logprobs[mask].mean():.4f}; "
          f"entropy {a.entropy[mask].mean():.4f} vs {e.entropy[mask].mean():.4f}")
    return meg, ref, batch, diff


@pytest.fixture(scope="module")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct from the catalog (imported on first use from its PyPI package)."""
    from noria.models.catalog import CatalogError, model_path

    try:
        return model_path("smollm2-135m-instruct")
    except (CatalogError, FileNotFoundError) as e:
        pytest.skip(f"needs SmolLM2: {e}")


def text_batch(folder, n: int = 12):
    """Arithmetic questions and correct worked answers in SmolLM2's chat template: real text, so the
    logprobs are those of a model that knows what comes next (|logprob| ~1, not ~12)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    samples = []
    for i in range(n):
        a, b = 17 * i + 3, 29 * i + 11
        chat = [{"role": "user", "content": f"What is {a} + {b}? Think step by step, then give the answer."}]
        prompt = tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]
        response = tok(f"We add {a} and {b}. {a} + {b} = {a + b}. The answer is {a + b}.", add_special_tokens=False)["input_ids"]
        samples.append(Sample(prompt_ids=prompt, response_ids=response, loss_mask=[1] * len(response),
                              rollout_logprobs=[-1.0] * len(response), index=i))
    return pack_samples(samples, torch.linspace(-1, 1, n).tolist())


def five_steps(meg, ref, batch, loss_tol=(5e-3, 0.02), norm_rel=0.05, label=""):
    """Five RL steps on both backends, printed side by side; losses (absolute + relative tolerance) and
    grad norms (relative) must track; ``loss_tol=None`` prints without judging."""
    old = ref.compute_logprobs(batch).logprobs
    print(f"{label}step  loss(megatron)  loss(fsdp)  grad_norm(megatron)  grad_norm(fsdp)")
    for step in range(5):
        m, f = meg.train_step(batch, old_logprobs=old), ref.train_step(batch, old_logprobs=old)
        print(f"{step + 1:>4}  {m['loss']:+.6f}  {f['loss']:+.6f}  {m['grad_norm']:.4f}  {f['grad_norm']:.4f}")
        assert m["skipped"] == 0.0 and m["step"] == step + 1
        if loss_tol:
            assert m["loss"] == pytest.approx(f["loss"], abs=loss_tol[0] + loss_tol[1] * abs(f["loss"]))
            assert m["grad_norm"] == pytest.approx(f["grad_norm"], rel=norm_rel)
    after = meg.compute_logprobs(batch).logprobs
    assert not torch.equal(after, old)  # the steps changed the policy


def test_logprobs_and_five_steps_track_fsdp(dense_dir):
    """Qwen3-0.6B shape, random bf16 weights: the same logprobs within bf16 rounding, then five RL steps
    whose losses and grad norms follow FSDP's (printed side by side)."""
    meg, ref, batch, diff = compare_logprobs(dense_dir, 151936)
    assert diff.mean() < 2e-2 and diff.max() < 0.1  # bf16 parameters vs bf16 autocast over fp32: ~1e-2 at |logprob| ~12
    five_steps(meg, ref, batch)


def test_real_smollm2_logprobs_and_five_steps_track_fsdp(smollm2_dir):
    """The real SmolLM2 (tied embeddings, 30 layers, GQA) on real text. bf16: logprobs no further from
    fp32's than FSDP's own bf16 run, five steps printed side by side (Megatron keeps bf16 parameters
    beside fp32 masters, FSDP casts fp32 parameters per matmul: at lr 1e-5 most updates fall below
    bf16's resolution differently, so the curves drift apart by ~1e-2). fp32: five steps equal."""
    batch = text_batch(smollm2_dir)
    meg, ref, _, diff = compare_logprobs(smollm2_dir, None, batch)
    fp32_ref = backend(smollm2_dir, "single", param_dtype="float32")
    exact = fp32_ref.compute_logprobs(batch).logprobs
    mask = batch.loss_mask > 0
    meg_err = (meg.compute_logprobs(batch).logprobs - exact)[mask].abs().mean()
    ref_err = (ref.compute_logprobs(batch).logprobs - exact)[mask].abs().mean()
    print(f"mean |logprob - fp32's|: megatron bf16 {meg_err:.2e}, fsdp bf16 {ref_err:.2e}")
    assert meg_err < 2 * ref_err + 1e-3 and diff.max() < 0.5  # bf16 tolerance: no further from fp32 than FSDP's bf16
    five_steps(meg, ref, batch, loss_tol=None, label="bf16 ")
    fp32_meg = backend(smollm2_dir, "megatron", param_dtype="float32")
    five_steps(fp32_meg, fp32_ref, batch, loss_tol=(1e-4, 2e-3), norm_rel=5e-3, label="fp32 ")


def test_hf_round_trip_and_weight_stream(dense_dir, tmp_path):
    """Export right after loading gives the input files back bit for bit; the sync stream has FSDP's
    names, dtypes and values; after a step the stream and the export agree."""
    meg = backend(dense_dir, "megatron")
    meg.export_hf(tmp_path / "out", dtype=torch.bfloat16)
    src, out = load_file(dense_dir / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(src) == sorted(out)
    for name, t in src.items():
        assert torch.equal(t, out[name]), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "qwen3"
    ref = backend(dense_dir, "single")
    stream = [(n, t) for bucket in meg.state_dict_for_sync(64 << 20) for n, t in bucket]
    expected = [(n, t) for bucket in ref.state_dict_for_sync(64 << 20) for n, t in bucket]
    assert [n for n, _ in stream] == [n for n, _ in expected]
    for (n, t), (_, e) in zip(stream, expected):
        assert t.dtype == e.dtype == torch.bfloat16 and t.is_cuda and torch.equal(t, e), n
    meg.train_step(rl_batch(151936, n=4))
    stream = {n: t.cpu() for bucket in meg.state_dict_for_sync(64 << 20) for n, t in bucket}
    meg.export_hf(tmp_path / "after", dtype=torch.bfloat16)
    after = load_file(tmp_path / "after" / "model.safetensors")
    assert any(not torch.equal(after[n], src[n]) for n in src)
    for name, t in after.items():
        assert torch.equal(stream[name], t), name


def test_checkpoint_restores_the_same_model(dense_dir, tmp_path):
    meg = backend(dense_dir, "megatron")
    batch = rl_batch(151936, n=4)
    meg.train_step(batch)
    meg.save(tmp_path / "ckpt", extra={"cursor": 7})
    saved = meg.compute_logprobs(batch).logprobs
    m2 = meg.train_step(batch)
    again = backend(dense_dir, "megatron")
    assert again.load(tmp_path / "ckpt") == {"cursor": 7} and again.optimizer_steps == 1
    torch.testing.assert_close(again.compute_logprobs(batch).logprobs, saved, atol=0, rtol=0)
    m2b = again.train_step(batch)  # the same masters and Adam state: the same second step
    assert m2b["loss"] == pytest.approx(m2["loss"], rel=1e-4) and m2b["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-3)


def test_moe_logprobs_steps_and_round_trip(moe_dir, tmp_path):
    """A small Qwen3-MoE (16 experts, top-4, first layer dense): Megatron's router and SequentialMLP
    give FSDP's logprobs; a step trains; the HF round trip is exact."""
    meg, ref, batch, diff = compare_logprobs(moe_dir, MOE["vocab_size"])
    assert diff.mean() < 2e-2 and diff.max() < 0.2  # a near-tie route may flip in bf16
    m, f = meg.train_step(batch), ref.train_step(batch)
    print(f"moe step: loss {m['loss']:+.6f} vs {f['loss']:+.6f}, grad_norm {m['grad_norm']:.4f} vs {f['grad_norm']:.4f}")
    assert m["grad_norm"] == pytest.approx(f["grad_norm"], rel=0.1)
    fresh = backend(moe_dir, "megatron")
    fresh.export_hf(tmp_path / "moe", dtype=torch.bfloat16)
    src, out = load_file(moe_dir / "model.safetensors"), load_file(tmp_path / "moe" / "model.safetensors")
    assert sorted(src) == sorted(out) and all(torch.equal(src[n], out[n]) for n in src)


def test_refusals_on_cuda(dense_dir):
    from noria.train import TrainError

    cfg = TrainConfig(backend="megatron", device="cuda")
    cfg.megatron.pp = 2
    with pytest.raises(TrainError, match="pipeline parallelism"):
        build_backend(cfg)
    with pytest.raises(TrainError, match="engine.deterministic"):
        build_backend(TrainConfig(backend="megatron", device="cuda"), deterministic=True)
