"""Helpers shared by the trainer tests: random samples, a test loss, weight snapshots."""

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


def weights(backend) -> dict[str, torch.Tensor]:
    """The backend's full fp32 weights by HF name (collective under FSDP)."""
    return {name: t.clone() for name, t in backend._full_tensors(torch.float32)}
