"""The ``mlp`` drafter: a small draft model on the policy's last hidden state, trained online.

Model. A draft chain starts from the served model's final normed hidden state h_t (the one whose
logits gave token x_{t+1}) and x_{t+1}. Each stage i maps the state and the embedding of the token
before it to a new state, and the policy's own head reads it:

    s_0 = h_t;   s_{i+1} = rms_norm(s_i + W_out silu(W_in [s_i ; E(x_{t+1+i})]));   x_{t+2+i} ~ q_i = head(s_{i+1})

A greedy request's draft takes each q_i's argmax; a sampled request's draws from q_i at its own
temperature and truncation, and the verifier accepts with min(1, p/q), so a drafter that matches the
model's distribution gets its draft accepted even where that distribution is flat (on SmolLM2
rollouts at T=0.7: 0.45 of first drafts against 0.40 for the argmax, measured offline).

One stage module serves every position of the chain (any ``num_tokens``). E and the head are the
policy's (frozen: read from the served model at each use, so they follow weight updates); the
drafter owns only W_in [2H -> H], W_out [H -> H] and the norm's weight (1.0M parameters for
SmolLM2-135M's H = 576). The head is cut to the ``draft_vocab`` tokens the engine sampled most often
(their rows of the policy's head): a full 49,152-row head would make each draft token cost a fifth
of a forward of SmolLM2-135M; 2048 rows cost ~1%. This is the MLP speculator of IBM's
"Accelerating Production LLMs with Combined Token/Embedding Speculators" (2024), with its stages'
weights shared and the policy's embeddings and head in place of its own: written here because no
library trains one online inside an engine (vLLM serves a trained ``MLPSpeculator``; it does not
train one), and because it has no KV cache of its own, so rejected drafts need no bookkeeping.

Online training. The engine records, for every token it samples, the hidden state that produced
it (``Speculator.observe``); a finished request gives its output as (hidden [N, H], tokens [N]). A
training position j teaches every stage at once (teacher forcing): from (h_j, x_j) the chain must
give x_{j+1}, x_{j+2}, ... (cross-entropy over the draft vocabulary; a target outside it, or past
the end of its request, is skipped). The buffer keeps the newest ``buffer_tokens`` tokens, so the
drafter follows the policy as its weights move. A round of ``train_steps`` AdamW steps starts once
``train_every_tokens`` new tokens were collected; the engine runs one step at a time between its
steps while it has no request (``Engine._loop``), so a request never waits behind more than one.

Exactness does not depend on the drafter: every draft is verified by the model with exact
rejection sampling (``noria.engine.speculative``); a poor drafter costs speed, never correctness.

State (``state_dict``): the stage weights, the optimizer, the token counts that pick the draft
vocabulary, and the policy's vocabulary and hidden sizes, checked at load (``engine.speculative.
model_path``; the job's checkpoints keep it as ``drafter.pt``).
"""

from __future__ import annotations

import hashlib
import json
import pickle
import time
from collections import deque
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from noria.config.engine import SpeculativeConfig
from noria.config.schema import ConfigError
from noria.engine.sampling import inverse_cdf, processed_weights


class Draft(NamedTuple):
    """One row's draft: its tokens and, for a sampled row, the distributions they were drawn from
    (``q`` [len(tokens), Vd] over the drafter's ``vocab``, normalised); None for a point mass."""

    tokens: list[int]
    q: torch.Tensor | None = None


class MlpDraftStage(nn.Module):
    """One stage of the chain (module docstring); fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.inp = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.out = nn.Linear(hidden_size, hidden_size, bias=False)
        self.norm = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        nn.init.zeros_(self.out.weight)  # untrained: the state passes through (normed)

    def forward(self, state: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        state = state + self.out(F.silu(self.inp(torch.cat([state, embed], dim=-1))))
        return F.rms_norm(state, (state.shape[-1],), self.norm, self.eps)


class MlpDrafter:
    """The stage module, its draft vocabulary, its training buffer and optimizer (module docstring).
    Used on the engine thread only."""

    UNROLL = 2
    """Stages a training position runs: the first from the model's own state, the next from the
    drafter's prediction (as it drafts), each against the model's state and token there."""
    CE_WEIGHT = 0.1
    """The token loss's weight beside the state regression (EAGLE's)."""

    def __init__(self, model: nn.Module, config: SpeculativeConfig, tokenizer=None) -> None:
        self.config = config
        self.tokenizer_id = tokenizer_fingerprint(tokenizer)
        """A hash of the policy tokenizer's vocabulary (None without a tokenizer), kept in the state."""
        self.model = model
        args = model.args
        self.vocab_size, self.hidden_size = args.vocab_size, args.hidden_size
        self.device = next(model.parameters()).device
        generator = torch.Generator().manual_seed(0)
        self._rng = torch.Generator().manual_seed(1)  # the training positions drawn: the same run draws the same
        self.stage = MlpDraftStage(self.hidden_size, args.rms_norm_eps)
        with torch.no_grad():
            self.stage.inp.weight.copy_(torch.randn(self.stage.inp.weight.shape, generator=generator) * (2 * self.hidden_size) ** -0.5)
            self.stage.norm.copy_(model.model.norm.weight.float())  # untrained, a stage passes its state on
        self.stage.to(self.device)
        self.optimizer = torch.optim.AdamW(self.stage.parameters(), lr=config.lr, weight_decay=0.0)
        self.counts = torch.zeros(self.vocab_size, dtype=torch.long)
        """Sampled tokens seen, per token id: the draft vocabulary is the most frequent."""
        self.vocab: torch.Tensor | None = None
        """The draft vocabulary's token ids [Vd] (device), or None before the first round."""
        self._slot: torch.Tensor | None = None  # token id -> row of the draft head, -1 outside it (device)
        self._head: torch.Tensor | None = None
        self._head_key: tuple | None = None
        self._buffer: deque[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = deque()
        """Finished outputs: (hidden [N, H], their tokens' embeddings [N, H], tokens [N])."""
        self._buffered = 0
        self._flat: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.new_tokens = 0
        """Tokens collected since the last round began."""
        self.steps = 0
        """Optimizer steps so far."""
        self.rounds = 0
        """Training rounds begun so far."""
        self.loss = 0.0
        """The last optimizer step's loss per position (state regression + CE_WEIGHT x token cross-entropy)."""
        self.train_s = 0.0
        """Seconds spent training so far."""
        self._round_left = 0
        self._round_head: torch.Tensor | None = None
        if config.model_path is not None:
            self.load(config.model_path)

    # ------------------------------------------------------------------------------ drafting

    @property
    def ready(self) -> bool:
        """Whether it may draft: trained (or loaded) at least once."""
        return self.vocab is not None

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The policy's embeddings of ``ids``, in the model's dtype."""
        return F.embedding(ids, self.model.model.embed_tokens.weight)

    def _draft_head(self) -> torch.Tensor:
        """The policy's head rows of the draft vocabulary, fp32 [Vd, H]; re-read after a weight
        update (a commit swaps or rewrites the head's storage) or a new vocabulary."""
        weight = self.model.lm_head.weight
        key = (weight.data_ptr(), weight._version, id(self.vocab))
        if key != self._head_key and weight.numel() > 0:  # empty: released for a colocated trainer's turn
            self._head = weight.detach().index_select(0, self.vocab).float()
            self._head_key = key
        return self._head

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, tokens: list[int], k: int, params: list | None = None,
                uniforms: torch.Tensor | None = None) -> list[Draft]:
        """Up to k draft tokens per row from hidden [S, H] (the states that gave ``tokens``) and those
        tokens. A greedy row (or any row without ``params``) drafts the drafter's argmax, a point
        mass; a sampled row draws each token from the drafter's own sampling distribution q (the
        row's temperature and truncation over the draft vocabulary, ``processed_weights``) with
        ``uniforms`` [S, k], and its :class:`Draft` carries q for exact speculative sampling. A
        row's draft ends before the first token where the product of the drafter's top
        probabilities so far falls below ``draft_confidence`` (its chance of being accepted whole,
        were the drafter right)."""
        head = self._draft_head()
        state = hidden.float()
        ids = torch.tensor(tokens, device=self.device)
        sampled = [i for i, p in enumerate(params or []) if not p.greedy]
        rows = torch.tensor(sampled, dtype=torch.long, device=self.device)
        row_params = [params[i] for i in sampled]
        drafts, confidence, dists = [], [], []
        sure = torch.ones(len(tokens), device=self.device)
        for i in range(k):
            state = self.stage(state, self._embed(ids).float())
            logits = state @ head.T
            p, slot = torch.softmax(logits, dim=-1).max(dim=-1)
            if sampled:
                q = processed_weights(logits.index_select(0, rows), row_params)
                q = q / q.sum(dim=-1, keepdim=True)
                slot = slot.index_copy(0, rows, inverse_cdf(q, uniforms.index_select(0, rows)[:, i].to(q.device)))
                dists.append(q)
            ids = self.vocab.index_select(0, slot)
            sure = sure * p
            drafts.append(ids)
            confidence.append(sure)
        keep = (torch.stack(confidence, dim=1) >= self.config.draft_confidence).sum(dim=1).tolist()
        out = [Draft(d[:n]) for d, n in zip(torch.stack(drafts, dim=1).tolist(), keep)]
        if sampled:
            q = torch.stack(dists, dim=1)  # [sampled rows, k, Vd]
            for j, i in enumerate(sampled):
                out[i] = Draft(out[i].tokens, q[j, : len(out[i].tokens)])
        return out

    # ------------------------------------------------------------------------------ training

    def add(self, hidden: torch.Tensor, tokens: list[int]) -> None:
        """One finished request's output: hidden [N, H] (row j gave tokens[j]) and its N tokens.
        Called right after the engine step that finished it, while the served weights are live: the
        tokens' embeddings are looked up now, and a round that becomes due takes its vocabulary and
        head rows now (a colocated trainer's turn may free the live weights while the engine idles)."""
        if not self.config.online_training or len(tokens) < 2:
            return
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        self.counts += torch.bincount(ids.cpu(), minlength=self.vocab_size)
        self._buffer.append((hidden.detach(), self._embed(ids).detach(), ids))
        self._buffered += len(tokens)
        self.new_tokens += len(tokens)
        while self._buffered - len(self._buffer[0][2]) >= self.config.buffer_tokens:
            self._buffered -= len(self._buffer.popleft()[2])
        self._flat = None
        if self._round_left == 0 and self.new_tokens >= self.config.train_every_tokens:
            self._begin_round()

    def _begin_round(self) -> None:
        self._round_left = self.config.train_steps
        self.new_tokens = 0
        self.rounds += 1
        self._set_vocab(torch.topk(self.counts, min(self.config.draft_vocab, self.vocab_size)).indices.sort().values)
        self._round_head = self._draft_head()

    def train_due(self) -> bool:
        """Whether a round has optimizer steps left."""
        return self._round_left > 0

    def train_step(self) -> float:
        """One optimizer step of the current round; returns its loss."""
        began = time.perf_counter()
        try:
            return self._step()
        finally:
            self._round_left -= 1  # after the step: a caller seeing no step due sees its loss
            self.train_s += time.perf_counter() - began

    def _step(self) -> float:
        hidden, embeds, ids, left = self._flat_buffer()
        starts = torch.nonzero(left > 0).squeeze(1)
        pick = torch.randint(len(starts), (min(self.config.train_batch, len(starts)),), generator=self._rng)
        starts = starts[pick.to(self.device)]
        head = self._round_head
        state = hidden.index_select(0, starts).float()
        losses, counted = [], 0
        for i in range(self.UNROLL):
            valid = left.index_select(0, starts) > i
            if not valid.any():
                break
            state, ahead = state[valid], starts[valid] + i + 1  # the position whose state this stage predicts
            starts = starts[valid]
            state = self.stage(state, embeds.index_select(0, ahead - 1).float())
            slot = self._slot.index_select(0, ids.index_select(0, ahead))
            known = slot >= 0
            regression = F.smooth_l1_loss(state, hidden.index_select(0, ahead).float(), reduction="sum") / state.shape[1]
            losses.append(regression + self.CE_WEIGHT * F.cross_entropy(state[known] @ head.T, slot[known], reduction="sum"))
            counted += len(starts)
        if not losses:
            return self.loss
        loss = torch.stack(losses).sum() / counted
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.steps += 1
        self.loss = float(loss.detach())
        return self.loss

    def _set_vocab(self, vocab: torch.Tensor) -> None:
        vocab = vocab.to(self.device)
        if self.vocab is not None and torch.equal(vocab, self.vocab):
            return
        self.vocab = vocab
        self._slot = torch.full((self.vocab_size,), -1, dtype=torch.long, device=self.device)
        self._slot[vocab] = torch.arange(len(vocab), device=self.device)

    def _flat_buffer(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The buffer as one [T, H] hidden tensor, the [T, H] embeddings of its T tokens, the tokens,
        and per position how many tokens follow it in its own request (a start needs at least one)."""
        if self._flat is None:
            hidden = torch.cat([h for h, _, _ in self._buffer])
            embeds = torch.cat([e for _, e, _ in self._buffer])
            ids = torch.cat([t for _, _, t in self._buffer])
            left = torch.cat([torch.arange(len(t) - 1, -1, -1, device=self.device) for _, _, t in self._buffer])
            self._flat = (hidden, embeds, ids, left)
        return self._flat

    # ------------------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {
            "kind": "mlp",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "tokenizer": self.tokenizer_id,
            "stage": {k: v.detach().cpu() for k, v in self.stage.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "counts": self.counts.clone(),
            "vocab": None if self.vocab is None else self.vocab.cpu(),
            "steps": self.steps,
            "rounds": self.rounds,
            "loss": self.loss,
        }

    def save(self, path: str | Path) -> Path:
        """Write :meth:`state_dict` to ``path`` (through a temporary file: never a partial one)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(self.state_dict(), tmp)
        tmp.replace(path)
        return path

    def load(self, path: str | Path) -> None:
        """Start from a saved drafter; refused when it was made for another vocabulary or hidden size."""
        path = Path(path)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
            raise ConfigError(f"engine.speculative.model_path {path}: not a drafter saved by noria ({e})") from e
        self.load_state_dict(state, str(path))

    def load_state_dict(self, state: dict, where: str = "the drafter state") -> None:
        if state.get("kind") != "mlp":
            raise ConfigError(f"{where}: not an mlp drafter (kind {state.get('kind')!r})")
        for key, mine in (("vocab_size", self.vocab_size), ("hidden_size", self.hidden_size)):
            if state.get(key) != mine:
                raise ConfigError(
                    f"{where} was trained for a policy with {key} {state.get(key)}; the served policy has {key} {mine}: "
                    "a drafter drafts in its policy's vocabulary and reads its hidden states, so it must come from the same "
                    "model family and tokenizer"
                )
        theirs = state.get("tokenizer")
        if theirs is not None and self.tokenizer_id is not None and theirs != self.tokenizer_id:
            raise ConfigError(
                f"{where} was trained with a tokenizer whose vocabulary hashes to {theirs[:12]}; the served policy's hashes "
                f"to {self.tokenizer_id[:12]}: the same token ids would mean other tokens"
            )
        self.stage.load_state_dict({k: v.to(self.device) for k, v in state["stage"].items()})
        if state.get("optimizer"):
            self.optimizer.load_state_dict(state["optimizer"])
        self.counts = state["counts"].clone()
        if state.get("vocab") is not None:
            self._set_vocab(state["vocab"])
        self.steps, self.rounds, self.loss = int(state["steps"]), int(state["rounds"]), float(state["loss"])


def tokenizer_fingerprint(tokenizer) -> str | None:
    """sha256 of a tokenizer's vocabulary (token -> id, sorted), or None without one."""
    vocab = getattr(tokenizer, "get_vocab", None)
    if vocab is None:
        return None
    return hashlib.sha256(json.dumps(sorted(vocab().items())).encode()).hexdigest()
