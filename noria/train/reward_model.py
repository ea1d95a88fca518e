"""A scalar reward model on the trainer backend: pairwise Bradley-Terry (``train.algorithm: reward_model``).

How a step runs (``RewardModelBackend.train_pairs``)::

    pairs of token ids (chosen, rejected) --pack_pairs--> TrainBatch: chosen_0, rejected_0, chosen_1, ...
      -> packed forward of the decoder (noria.train.packed_forward.packed_hidden) -> hidden [N, H]
      -> ScoreModel: the score head (Linear H -> 1, no bias) at each sequence's LAST token -> r [2P]
      -> loss = mean over pairs of -log sigmoid(r(chosen) - r(rejected)) -> backward -> AdamW step

The score is read where transformers' ``*ForSequenceClassification`` reads it (the last token that is
not the pad id; the job refuses rows ending in the pad id), from the same final normed hidden state,
so the exported folder (``export_hf``: transformers' ``AutoModelForSequenceClassification`` with
``num_labels: 1`` made from the base model's folder, the trained backbone and head, the base model's
tokenizer files) scores a row as the trainer did, and is what ``reward.model.kind: scalar`` loads.

Micro-batches: the backend's token-budget micro-batches (and FSDP2's deal of them to ranks) may cut
a pair in two. When every micro-batch holds whole pairs (the usual case: pairs are short) each one's
loss is its pairs' share of the step's loss. Otherwise the step first scores every sequence without
gradients, then back-propagates ``sum_i g_i r_i`` per micro-batch, ``g_i`` the loss's derivative
with respect to ``r_i`` at those scores: the same gradient, for one more forward.

What the reward model trains: every weight of the decoder and the head (no LoRA, no frozen parts);
the LM head is kept but unused (the export leaves it out). Sequences run whole: no shared prompt
prefix (``train.share_prefix`` is ignored here). Metrics: ``loss``, ``pair_accuracy`` (share of the
step's pairs with r(chosen) > r(rejected), before the update), ``margin`` (mean r(chosen) - r(rejected)).

Not guaranteed: bitwise-equal scores between the trainer and the exported folder in bf16 (the
trainer computes under autocast from fp32 masters; the folder holds the weights in the compute dtype).
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from noria.config import TrainConfig
from noria.train.backend import TrainError
from noria.train.fsdp import FSDPBackend
from noria.train.packed_forward import packed_hidden
from noria.train.packing import batch_to, pack_samples, plan_micro_batches, slice_batch
from noria.types import Sample, TrainBatch

PairIds = tuple[list[int], list[int]]
"""(chosen ids, rejected ids) of one pair: prompt and response, as the reward model reads them."""


class ScoreModel(nn.Module):
    """The decoder with a one-logit score head read at each packed sequence's last token."""

    def __init__(self, lm: nn.Module, init_std: float) -> None:
        super().__init__()
        self.lm = lm
        args = getattr(lm, "args", None)
        hidden = args.hidden_size if args is not None else lm.config.hidden_size
        self.score = nn.Linear(hidden, 1, bias=False)  # transformers' ``score`` of *ForSequenceClassification
        nn.init.normal_(self.score.weight, std=init_std)

    def forward(self, input_ids, positions, cu_seqlens, with_entropy: bool = False, *_layout, **_named):
        """Scores [N] (fp32): each sequence's score at its last token, 0 at every other token (the
        per-token shape the backend's ``compute_logprobs`` gathers across micro-batches and ranks).
        The other arguments the backend passes (the tokens wanted, a shared-prefix layout) do not
        apply: every sequence is scored once, and a reward model's batches are never prefix-shared
        (``reward_model_train_config``)."""
        hidden = packed_hidden(self.lm, input_ids, positions, cu_seqlens)
        last = (cu_seqlens[1:] - 1).long()
        scores = self.score(hidden.index_select(0, last)).squeeze(-1).float()
        out = torch.zeros(input_ids.numel(), dtype=torch.float32, device=hidden.device)
        return out.index_copy(0, last, scores), None


def initializer_range(lm: nn.Module) -> float:
    """The std transformers initializes a new head with (the model config's ``initializer_range``)."""
    config = getattr(lm, "hf_config", None)  # a native model's config.json, as a dict
    if config is None and getattr(lm, "config", None) is not None:  # a transformers model
        config = lm.config.to_dict()
    return float((config or {}).get("initializer_range", 0.02))


def pack_pairs(pairs: Sequence[PairIds]) -> TrainBatch:
    """Chosen and rejected of each pair as consecutive sequences (a pair at sequences 2k, 2k + 1);
    the last token of each carries the loss mask (one scored position per sequence)."""
    samples = []
    for chosen, rejected in pairs:
        for ids in (chosen, rejected):
            if len(ids) < 2:
                raise TrainError(f"a reward-model sequence needs at least 2 tokens, got {len(ids)}")
            samples.append(Sample(prompt_ids=list(ids[:-1]), response_ids=[ids[-1]], loss_mask=[1]))
    return pack_samples(samples)


def last_tokens(batch: TrainBatch) -> torch.Tensor:
    """Index of each packed sequence's last token."""
    return (batch.cu_seqlens[1:] - 1).long()


def pair_metrics(scores: torch.Tensor) -> dict[str, float]:
    """``loss``, ``pair_accuracy`` and ``margin`` of scores laid out as ``pack_pairs`` packs them."""
    margin = scores[0::2] - scores[1::2]
    return {
        "loss": float(-F.logsigmoid(margin).mean()),
        "pair_accuracy": float((margin > 0).float().mean()),
        "margin": float(margin.mean()),
    }


def reward_model_train_config(cfg: TrainConfig) -> TrainConfig:
    """The trainer config the reward model runs with: no shared prefixes (whole sequences)."""
    out = copy.deepcopy(cfg)
    out.share_prefix = False
    return out


class RewardModelBackend(FSDPBackend):
    """The reward model on the PyTorch backend (single process or FSDP2); see the module docstring."""

    def __init__(self, cfg: TrainConfig, model_impl: str = "auto", seed: int = 0, pad_id: int = 0) -> None:
        super().__init__(reward_model_train_config(cfg), loss_fn=_unused_loss, model_impl=model_impl, seed=seed)
        self.pad_id = int(pad_id)
        """Written as the exported config's ``pad_token_id`` (where transformers stops reading a row)."""

    def _head_model(self, lm: nn.Module) -> nn.Module:
        return ScoreModel(lm, initializer_range(lm))

    # -------------------------------------------------------------------------------- scores

    @torch.no_grad()
    def scores(self, batch: TrainBatch) -> torch.Tensor:
        """Every sequence's score [S] (fp32, CPU), no gradient; collective under FSDP2."""
        return self.compute_logprobs(batch, "current", trained_only=True).logprobs[last_tokens(batch)]

    # -------------------------------------------------------------------------------- train

    def train_pairs(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step of the Bradley-Terry loss over the pairs of ``batch`` (``pack_pairs``)."""
        t0 = time.perf_counter()
        n_pairs = batch.n_sequences // 2
        if n_pairs == 0 or batch.n_sequences % 2:
            raise TrainError(f"train_pairs: a batch of pairs holds an even number of sequences, got {batch.n_sequences}")
        whole = all(a % 2 == 0 and b % 2 == 0 for a, b in plan_micro_batches(batch, self.cfg.micro_batch_tokens))
        grad, before = None, None
        if not whole:  # a pair is cut between micro-batches: score first, then push the exact gradient
            scores = self.scores(batch)
            before = pair_metrics(scores)
            margin = scores[0::2] - scores[1::2]
            pull = torch.sigmoid(-margin) / n_pairs  # d loss / d r(rejected); minus that for r(chosen)
            grad = torch.stack([-pull, pull], dim=1).reshape(-1)

        def micro(b: TrainBatch, lo: int, hi: int, _tokens: float, _seqs: int):
            return self._pair_loss(b, lo, hi, n_pairs, grad)

        out = self._optimizer_step(batch, micro)
        if before is not None:
            out.update(before)
        out.update(step_time_s=time.perf_counter() - t0)
        return out

    def _pair_loss(self, batch: TrainBatch, lo: int, hi: int, n_pairs: int, grad: torch.Tensor | None):
        mb = batch_to(slice_batch(batch, lo, hi), self.device)
        out, _ = self._forward(self.policy, mb, False)
        scores = out[last_tokens(mb)]
        if grad is not None:  # the step's loss has this gradient with respect to these scores
            return (scores * grad[lo:hi].to(scores.device)).sum(), {}
        margin = scores[0::2] - scores[1::2]
        loss = -F.logsigmoid(margin).sum() / n_pairs
        d, n = margin.detach(), float(margin.numel())
        return loss, {"pair_accuracy": (float((d > 0).sum()), n), "margin": (float(d.sum()), n)}

    # ------------------------------------------------------------------------------- export

    def state_dict_for_sync(self, bucket_bytes: int, cast: bool = True):
        raise TrainError("a reward model is not sent to rollout engines: export it (export_hf) and name it in reward.model")

    def export_hf(self, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
        """Write an ``AutoModelForSequenceClassification`` folder (``num_labels`` 1, ``pad_token_id``,
        the trained backbone and head in ``dtype``, default the compute dtype, and the base model's
        tokenizer files); collective under FSDP2, rank 0 writes."""
        dtype = dtype or self.compute_dtype
        state = {name: t.cpu() for name, t in self._full_tensors(dtype)}
        head = self.policy.score.weight
        head = (head.full_tensor() if hasattr(head, "full_tensor") else head).detach().to(dtype).cpu()
        if self.rank == 0:
            save_classifier(self._materialize(state, dtype), head, self.model_path, folder, self.pad_id, dtype)
        if self.distributed:
            dist.barrier()
        return Path(folder)


def save_classifier(lm: nn.Module, head: torch.Tensor, source: Path, folder: str | Path, pad_id: int, dtype: torch.dtype) -> None:
    """Save ``lm`` (a causal LM holding the trained backbone) as a sequence-classification folder with
    ``head`` as its score: transformers maps the backbone's weights from the causal LM's folder."""
    from transformers import AutoModelForSequenceClassification

    from noria.models import save_model
    from noria.models.checkpoint import atomic_folder, copy_companion_files

    target = Path(folder)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.causal-", dir=target.parent) as scratch, quiet_transformers():
        causal = save_model(lm, Path(scratch) / "lm")
        model, info = AutoModelForSequenceClassification.from_pretrained(
            causal, num_labels=1, pad_token_id=pad_id, dtype=dtype, output_loading_info=True
        )  # its report of the new score head (checked below) and progress bars would only be noise here
    missing = [k for k in info["missing_keys"] if k != "score.weight"]
    if missing:
        raise TrainError(f"export: the backbone's weights did not map onto {type(model).__name__}: missing {missing[:5]}")
    with torch.no_grad():
        model.score.weight.copy_(head)
    model.config.pad_token_id = pad_id
    with atomic_folder(target) as tmp, quiet_transformers():
        model.save_pretrained(tmp)
        copy_companion_files(source, tmp)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings and progress bars off for the block, as they were after it."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _unused_loss(inputs):  # the reward model trains through train_pairs, never train_step
    raise TrainError("RewardModelBackend.train_step is not used: call train_pairs(pack_pairs(pairs))")
