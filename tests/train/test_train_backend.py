"""Single-process trainer backend: packed logprobs, split-invariant steps, checkpoints, guards, export.

CPU only, tiny random Llama (``tiny_model_dir``); each test takes about a second.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from noria.train.backend import NonFiniteError, TokenLogprobs, TrainBackend
from noria.train.checkpoint import CheckpointError, checkpoint_dir, latest_checkpoint
from noria.train.packing import pack_samples
from train_util import make_backend, pg_loss, random_samples, weights


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _batch(seed=0, n=6):
    samples = random_samples(n, seed=seed)
    advantages = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)).tolist()
    return pack_samples(samples, advantages)


def test_backend_satisfies_contract(tiny_model_dir):
    assert isinstance(make_backend(tiny_model_dir), TrainBackend)


def test_packed_logprobs_equal_per_sequence_hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    backend = make_backend(tiny_model_dir, micro_batch_tokens=20)
    samples = random_samples(6)
    batch = pack_samples(samples)
    out = backend.compute_logprobs(batch, with_entropy=True)
    assert isinstance(out, TokenLogprobs) and out.logprobs.shape == (batch.n_tokens,)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for i, s in enumerate(samples):
        ids = torch.tensor(s.prompt_ids + s.response_ids)
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids[None]).logits[0].float(), -1)[:-1]
        want = logp.gather(-1, ids[1:, None])[:, 0]
        want_ent = -(logp.exp() * logp).sum(-1)
        lo, hi = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
        assert out.logprobs[lo] == 0 and out.entropy[lo] == 0
        torch.testing.assert_close(out.logprobs[lo + 1 : hi], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.entropy[lo + 1 : hi], want_ent, atol=1e-5, rtol=1e-5)


def test_micro_batch_split_does_not_change_the_step(tiny_model_dir):
    batch = _batch()
    one = make_backend(tiny_model_dir, micro_batch_tokens=10_000)  # 1 micro-batch of N sequences
    many = make_backend(tiny_model_dir, micro_batch_tokens=1)  # N micro-batches of 1 sequence
    m1, m2 = one.train_step(batch), many.train_step(batch)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5, abs=1e-7)
    w1, w2 = weights(one), weights(many)
    for name in w1:
        # Adam's first step is ~lr * sign(g): a gradient near zero turns fp32 summation-order noise
        # into up to ~1e-5 of an lr of 1e-2, so the bound is a fraction of lr, not fp32 epsilon.
        torch.testing.assert_close(w1[name], w2[name], atol=1e-4, rtol=0)
    assert any(not torch.equal(w1[n], w0) for n, w0 in weights(make_backend(tiny_model_dir)).items())


def test_bf16_autocast_step_and_activation_checkpointing(tiny_model_dir):
    batch = _batch()
    plain = make_backend(tiny_model_dir, param_dtype="bfloat16")
    ckpt = make_backend(tiny_model_dir, param_dtype="bfloat16", activation_checkpointing=True)
    m1, m2 = plain.train_step(batch), ckpt.train_step(batch)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-6)
    p = next(plain.policy.parameters())
    assert p.dtype == torch.float32  # master weights stay fp32
    for (name, t), (_, u) in zip(weights(plain).items(), weights(ckpt).items()):
        assert torch.equal(t, u), name
    sync = [t for bucket in plain.state_dict_for_sync(1 << 20) for _, t in bucket]
    assert {t.dtype for t in sync} == {torch.bfloat16}


def test_save_load_step_is_bitwise_equal_to_uninterrupted(tiny_model_dir, tmp_path):
    b1, b2 = _batch(1), _batch(2)
    kw = {"param_dtype": "bfloat16", "optim": {"schedule": "cosine", "warmup_steps": 1, "total_steps": 4}}
    run = make_backend(tiny_model_dir, **kw)
    run.train_step(b1)
    folder = run.save(checkpoint_dir(tmp_path, run.optimizer_steps), extra={"cursor": 17})
    m_run = run.train_step(b2)

    resumed = make_backend(tiny_model_dir, **kw)
    assert resumed.load(latest_checkpoint(tmp_path)) == {"cursor": 17}
    assert resumed.optimizer_steps == 1
    m_res = resumed.train_step(b2)
    assert m_res["loss"] == m_run["loss"] and m_res["lr"] == m_run["lr"]
    for (name, t), (_, u) in zip(weights(run).items(), weights(resumed).items()):
        assert torch.equal(t, u), name
    assert json.loads((folder / "trainer_state.json").read_text())["optimizer_steps"] == 1


def test_checkpoint_of_the_old_field_names_still_loads(tiny_model_dir, tmp_path):
    # Before issue 20 the count was "step" and a mirrored "weight_version" sat beside it.
    run = make_backend(tiny_model_dir)
    run.train_step(_batch(1))
    folder = run.save(checkpoint_dir(tmp_path, 1), extra={"cursor": 3})
    state_file = folder / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["step"] = state.pop("optimizer_steps")
    state["weight_version"] = 1
    state_file.write_text(json.dumps(state))
    resumed = make_backend(tiny_model_dir)
    assert resumed.load(folder) == {"cursor": 3} and resumed.optimizer_steps == 1


def test_uncommitted_checkpoint_is_refused(tiny_model_dir, tmp_path):
    backend = make_backend(tiny_model_dir)
    good = backend.save(checkpoint_dir(tmp_path, 1))
    backend.train_step(_batch())
    bad = backend.save(checkpoint_dir(tmp_path, 2))
    (bad / "COMMITTED").unlink()  # as if the writer died before committing
    assert latest_checkpoint(tmp_path) == good
    with pytest.raises(CheckpointError, match="not committed"):
        backend.load(bad)
    with pytest.raises(CheckpointError, match="not found"):
        backend.load(tmp_path / "nowhere")


def _nan_loss(x):
    loss, metrics = pg_loss(x)
    return loss * float("nan"), metrics


def test_nonfinite_step_raises_and_applies_nothing(tiny_model_dir):
    backend = make_backend(tiny_model_dir, loss_fn=_nan_loss)
    before = weights(backend)
    with pytest.raises(NonFiniteError, match="step 1"):
        backend.train_step(_batch())
    assert backend.optimizer_steps == 0
    for name, t in weights(backend).items():
        assert torch.equal(t, before[name])


def test_nonfinite_steps_skipped_up_to_the_limit(tiny_model_dir):
    backend = make_backend(tiny_model_dir, loss_fn=_nan_loss, max_nonfinite_skips=1)
    before = weights(backend)
    assert backend.train_step(_batch())["skipped"] == 1.0
    assert all(torch.equal(t, before[n]) for n, t in weights(backend).items())
    backend.loss_fn = pg_loss  # a good step resets the count of consecutive skips
    assert backend.train_step(_batch())["skipped"] == 0.0
    backend.loss_fn = _nan_loss
    backend.train_step(_batch())
    with pytest.raises(NonFiniteError, match="step 2"):
        backend.train_step(_batch())


def test_export_hf_loads_in_transformers_with_equal_logits(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    backend = make_backend(tiny_model_dir)
    backend.train_step(_batch())
    out = backend.export_hf(tmp_path / "hf", dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    AutoTokenizer.from_pretrained(out)  # tokenizer files travel with the weights
    ids = torch.tensor([[5, 9, 33, 100, 7, 250]])
    with torch.no_grad():
        want = backend.lm(ids)
        got = hf(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_state_dict_for_sync_matches_hf_checkpoint(tiny_model_dir):
    from safetensors import safe_open

    backend = make_backend(tiny_model_dir, param_dtype="bfloat16")
    buckets = list(backend.state_dict_for_sync(bucket_bytes=40_000))
    assert len(buckets) > 1 and all(buckets)
    got = {name: tuple(t.shape) for bucket in buckets for name, t in bucket}
    with safe_open(tiny_model_dir / "model.safetensors", framework="pt") as f:
        want = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert got == want


def test_lr_schedules():
    from noria.config import OptimConfig
    from noria.train.optim import lr_at

    cfg = OptimConfig(lr=1.0, warmup_steps=2, schedule="cosine", total_steps=6, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg, None) for s in range(7)]
    assert lrs[:3] == [0.5, 1.0, 1.0] and lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    lin = OptimConfig(lr=1.0, schedule="linear")
    assert [lr_at(s, lin, 4) for s in (0, 2, 4)] == [1.0, 0.5, 0.0]


def test_rl_objective_with_reference_and_entropy(tiny_model_dir):
    loss = {"kl_coef": 0.1, "entropy_coef": 0.01}
    backend = make_backend(tiny_model_dir, loss_fn=None, micro_batch_tokens=20, loss=loss)
    assert "reference" in backend.frozen
    batch = _batch()
    first = backend.train_step(batch)
    assert first["ref_kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any update
    assert first["approx_kl"] == pytest.approx(0.0, abs=1e-6) and "entropy" in first and "clip_frac" in first
    second = backend.train_step(batch)
    assert second["ref_kl"] > 0 and second["step"] == 2.0
    with pytest.raises(Exception, match="teacher"):
        backend.compute_logprobs(batch, "teacher")


def test_init_loads_reference_only_with_kl(tiny_model_dir):
    from noria.config import TrainConfig
    from noria.train.fsdp import FSDPBackend

    cfg = TrainConfig(param_dtype="bfloat16")
    cfg.loss.kl_coef = 0.05
    backend = FSDPBackend(cfg)
    backend.init(tiny_model_dir)
    ref = backend.frozen["reference"]
    assert all(not p.requires_grad and p.dtype == torch.bfloat16 for p in ref.parameters())
    assert "reference" not in make_backend(tiny_model_dir).frozen
    out = backend.compute_logprobs(_batch(), "reference")
    torch.testing.assert_close(out.logprobs, backend.compute_logprobs(_batch()).logprobs, atol=0.05, rtol=0.05)


def test_transformers_wrapper_trains_like_native(tiny_model_dir):
    from noria.config import TrainConfig
    from noria.train.fsdp import FSDPBackend

    batch = _batch()
    native = make_backend(tiny_model_dir)
    cfg = TrainConfig(param_dtype="float32", logprob_chunk_tokens=7)
    cfg.optim.lr = 1e-2
    hf = FSDPBackend(cfg, loss_fn=pg_loss, model_impl="hf")
    hf.init(tiny_model_dir)
    torch.testing.assert_close(hf.compute_logprobs(batch).logprobs, native.compute_logprobs(batch).logprobs, atol=1e-5, rtol=1e-5)
    assert hf.train_step(batch)["grad_norm"] == pytest.approx(native.train_step(batch)["grad_norm"], rel=1e-4)
    assert set(weights(hf)) == set(weights(native))  # HF names (order differs)


class _Payload:
    """Pickles as a call to ``pathlib.Path.touch(marker)``: code that runs when the file is unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_resume_loads_the_rng_file_as_data_never_runs_code(tiny_model_dir, tmp_path):
    backend = make_backend(tiny_model_dir)
    folder = backend.save(checkpoint_dir(tmp_path, 1))
    marker = tmp_path / "code-ran"
    torch.save({"torch": _Payload(marker)}, folder / "rng-0.pt")  # a run folder is data; this one is hostile
    with pytest.raises(CheckpointError, match="rng-0.pt"):
        backend.load(folder)
    assert not marker.exists()


def test_sync_buckets_and_checkpoint_shards_are_cut_by_one_rule(tiny_model_dir, tmp_path):
    from noria.models.checkpoint import INDEX_FILE, save_tensors
    from noria.sync import bucketize

    backend = make_backend(tiny_model_dir)
    limit = 30_000
    buckets = [[n for n, _ in b] for b in backend.state_dict_for_sync(limit)]
    state = dict(backend._full_tensors(backend.compute_dtype))
    assert buckets == [[n for n, _ in b] for b in bucketize(state, limit)] and len(buckets) > 2
    for names in buckets:  # at most the limit, unless one tensor alone is larger
        nbytes = sum(state[n].numel() * state[n].element_size() for n in names)
        assert nbytes <= limit or len(names) == 1
    assert [n for names in buckets for n in names] == list(state)  # every tensor once, in order
    save_tensors(state, tmp_path, max_shard_bytes=limit)
    weight_map = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]
    shards = [[n for n in state if weight_map[n] == f] for f in sorted(set(weight_map.values()))]
    assert shards == buckets
