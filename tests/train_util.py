"""Helpers shared by the trainer tests: random samples (also grouped, and with rewards for the critic),
a test loss, weight and gradient snapshots, a critic config."""

from __future__ import annotations

import torch

from noria.config import TrainConfig
from noria.train.backend import LossInputs
from noria.train.fsdp import FSDPBackend
from noria.types import Sample


def random_samples(n: int = 6, vocab: int = 500, seed: int = 0) -> list[Sample]:
    """Samples of varied prompt / response lengths, some response tokens not from the policy."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(1, 9, (1,), generator=g))
        r = int(torch.randint(1, 14, (1,), generator=g))
        mask = [int(x) for x in (torch.rand(r, generator=g) > 0.2).tolist()]
        out.append(
            Sample(
                prompt_ids=torch.randint(3, vocab, (p,), generator=g).tolist(),
                response_ids=torch.randint(3, vocab, (r,), generator=g).tolist(),
                loss_mask=mask,
                rollout_logprobs=(-torch.rand(r, generator=g) * 5).tolist(),
                weight_versions=[0] * r,
                index=i,
            )
        )
    return out


def pg_loss(x: LossInputs):
    """A simple policy-gradient loss with both step-wide normalisers (token and sequence means)."""
    b = x.batch
    per_tok = -(b.advantages * x.logprobs * b.loss_mask)
    token_mean = per_tok.sum() / max(x.total_tokens, 1.0)
    seq_sum = per_tok.new_zeros(b.n_tokens).index_add(0, x.seq_index, per_tok)
    seq_mean = seq_sum.sum() / max(x.total_seqs, 1)
    return token_mean + 0.1 * seq_mean, {"pg": (float(per_tok.detach().sum()), float(b.loss_mask.sum()))}


def make_backend(model_dir, loss_fn=pg_loss, **overrides) -> FSDPBackend:
    """An initialised backend on the tiny model; fp32 and a large LR unless overridden.

    ``loss_fn=None`` runs the configured objective (``train.algorithm`` / ``train.loss``).
    """
    fields = {"param_dtype": "float32", "logprob_chunk_tokens": 7}
    fields.update(overrides)
    sections = {k: fields.pop(k, {}) for k in ("optim", "loss", "lora")}
    cfg = TrainConfig(**fields)
    cfg.optim.lr = 1e-2
    for section, values in sections.items():
        for k, v in values.items():
            setattr(getattr(cfg, section), k, v)
    backend = FSDPBackend(cfg, loss_fn=loss_fn)
    backend.init(model_dir)
    return backend


def record_grads(backend: FSDPBackend) -> dict[str, torch.Tensor]:
    """The gradients the optimizer steps on, recorded at its step (which then runs as usual)."""
    grads: dict[str, torch.Tensor] = {}
    step = backend.optimizer.step

    def recording_step(*args, **kwargs):
        grads.update({n: p.grad.clone() for n, p in backend.policy.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    backend.optimizer.step = recording_step
    return grads


def weights(backend) -> dict[str, torch.Tensor]:
    """The backend's full fp32 weights by HF name (collective under FSDP)."""
    return {name: t.clone() for name, t in backend._full_tensors(torch.float32)}


def grouped_samples(groups=((12, 4), (9, 3), (3, 2), (10, 1)), vocab: int = 500, seed: int = 0) -> list[Sample]:
    """(prompt length, samples) per group; responses of varied lengths, some tokens untrained."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for prompt_len, n in groups:
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        for i in range(n):
            r = int(torch.randint(1, 9, (1,), generator=g))
            mask = [1] + [int(x) for x in (torch.rand(r - 1, generator=g) > 0.2).tolist()]
            out.append(Sample(
                prompt_ids=prompt, response_ids=torch.randint(3, vocab, (r,), generator=g).tolist(), loss_mask=mask,
                rollout_logprobs=(-torch.rand(r, generator=g) * 5).tolist(), weight_versions=[0] * r, index=i,
            ))
    return out


def samples_with_rewards(vocab: int = 200, seed: int = 0) -> list[Sample]:
    """Two prompts x 3 samples; one response holds two tool tokens (mask 0) between policy tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(2):
        prompt = torch.randint(3, vocab, (10,), generator=g).tolist()
        for i in range(3):
            r = 4 + i
            mask = [1] * r
            if k == 0 and i == 2:
                mask[2] = mask[3] = 0  # tool output inside the response
            out.append(Sample(
                prompt_ids=prompt, response_ids=torch.randint(3, vocab, (r,), generator=g).tolist(), loss_mask=mask,
                rollout_logprobs=[0.0] * r, weight_versions=[0] * r, reward=float((i + k) % 2), group_id=k, index=i,
            ))
    return out


def critic_config(**critic) -> TrainConfig:
    cfg = TrainConfig(param_dtype="float32", logprob_chunk_tokens=8, micro_batch_tokens=40)
    cfg.optim.lr = 1e-3
    cfg.critic.lr = 3e-3
    for k, v in critic.items():
        setattr(cfg.critic, k, v)
    return cfg
