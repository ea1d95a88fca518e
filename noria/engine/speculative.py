"""Speculative decoding in the built-in engine: an n-gram drafter and exact verification.

Drafter (``engine.speculative.method: ngram``, prompt lookup; no draft model). For a decoding
request, the last n tokens of prompt + output (n from ``ngram_max`` down to ``ngram_min``) are
looked up earlier in the same sequence; the latest earlier occurrence wins and the
``num_tokens`` tokens that followed it are the draft (where those run into the end of the
sequence, the copy continues from the draft itself: a repeating pattern keeps repeating). Each request keeps an index of its n-grams,
extended by the tokens added since the last lookup (:class:`NgramIndex`), so a lookup costs
O(ngram_max) per new token, not a scan of the sequence.

Verification. The decode chunk of a drafted request grows into a *verify chunk*
(``Chunk.draft``): its last sampled token followed by the k draft tokens, computed in one forward
like a prefill chunk (causal attention over the request's cache and the chunk). Its k + 1 logit
rows are all read: row i is the model's distribution for the position of draft token i + 1, row k
that of the token after the whole draft. Acceptance is exact speculative sampling: draft token d
at row i, drawn from the drafter's distribution q_i, is accepted with probability
min(1, p_i(d) / q_i(d)), p_i the request's sampling distribution (temperature, then
top-k/top-p/min-p); at the first rejection the token is drawn from max(0, p_i - q_i),
renormalised, which makes the row's token exactly p_i-distributed. The n-gram drafter's drafts
(and the mlp drafter's for greedy requests) are point masses, q_i = [d]: accepted with probability
p_i(d), resampled from p_i with d removed (P(d) = p(d), P(x ≠ d) = (1 - p(d)) p(x) / (1 - p(d))); a
sampled request's mlp draft carries its q (``Chunk.draft_q``). If all k are accepted, a bonus token is
drawn from row k. Greedy rows accept d iff it is the row's argmax, and take the argmax otherwise:
the tokens of greedy decoding. Each row draws its uniforms from the request's own generator when
seeded (so a seeded request does not depend on the batch), else from the engine's.

Logprobs are the model's: ``log_softmax(logits / T)`` of the chosen token at its row, the same op
as ``sampling.sample(exact_logprobs=True)``, so in deterministic mode (where a token's logits have
the same bits however it is chunked) a speculated token's logprob equals the trainer's bit for
bit. Every token of a verify step carries the step's weight version.

KV. A verify chunk writes K/V for its k + 1 positions; ``Scheduler.process`` counts as computed
only the last sampled token and the accepted drafts, so the slots of rejected drafts are simply
overwritten by the next step, and the prefix cache (which caches ``all_ids[:num_computed]``) never
holds a rejected token. Stop conditions are checked token by token (``Scheduler._append_verified``):
nothing past a stop is kept, and a draft never runs past ``max_new_tokens`` or the context.

Policy. A step speculates only while at most ``max_batch`` requests are running or waiting
(decoding, prefilling, or queued to: a large batch still admitting does not speculate; verify chunks
multiply the tokens of a step by up to k + 1: worth it where a decode step is bound by weight
reads, not where it is bound by compute), within ``max_batch_tokens``, and only when no request of
the step asks for top logprobs, routed experts or prefill scoring (those paths read one row per
chunk). While speculation is possible the engine does not overlap steps (``engine.overlap``):
each verify step needs the previous step's tokens on the host. On CUDA a verify step runs eagerly;
plain decode steps keep their CUDA graphs.

Not guaranteed: the same samples as without speculation for a seeded request at temperature > 0
(the same distribution, other draws); bitwise-equal logprobs outside deterministic mode (a
verify chunk runs the prefill path, whose rounding may differ from decode's).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable

import torch

from noria.config.engine import SpeculativeConfig
from noria.engine import scoring
from noria.engine.sampling import inverse_cdf, log_softmax_rows, processed_weights, sample
from noria.engine.drafter import Draft, MlpDrafter
from noria.engine.scheduler import Chunk, Req, ReqState, Scheduler

log = logging.getLogger(__name__)


class NgramIndex:
    """Latest earlier occurrence of every n-gram (n in [n_min, n_max]) of one token sequence."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._follow: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self._indexed = 0
        """Positions j < this are indexed: every n-gram ending just before j maps to j (or later)."""

    def draft(self, ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching
        suffix n-gram of ``ids``; empty when none occurs."""
        end = len(ids)
        for j in range(max(self._indexed, 1), end):  # index n-grams that have a following token
            for n, table in self._follow.items():
                if j >= n:
                    table[tuple(ids[j - n : j])] = j
        self._indexed = max(self._indexed, end)
        for n in range(self.n_max, self.n_min - 1, -1):
            if end < n:
                continue
            j = self._follow[n].get(tuple(ids[end - n :]))
            if j is not None:  # ids[end + i] is predicted as ids[j + i], past the end from the draft itself
                draft: list[int] = []
                for i in range(k):
                    draft.append(ids[j + i] if j + i < end else draft[j + i - end])
                return draft
        return []


class SpeedPolicy:
    """``engine.speculative.policy: measured``: speculate a step only where this engine's own
    measurements say it pays for the rows it holds.

    Costs (hardware and model): steps run in stretches of one kind, speculating or plain, within one
    batch-size bucket (``(rows - 1).bit_length()``: 1, 2, 3-4, 5-8, ...), ``STRETCH`` steps at most.
    A stretch's first ``TRANSITION`` steps are not timed (the engine switches step overlap on or off
    there); the rest give its seconds per step, a step's seconds being the time between the ends of
    it and the step before, and each (bucket, kind) keeps a moving average.

    Gains (content): each request keeps a moving average of the drafts it had accepted per
    speculating step (0 for a step it got no draft in), ``PRIOR`` before it first speculated; after
    each plain stretch it moves ``RECOVER`` of the way back to ``PRIOR``, so a request whose text
    turns copyable is tried again (one stretch in about 128 steps where a speculating step costs 1.5
    plain ones and drafts are never accepted: 6% of the steps).

    A stretch's kind: a kind whose cost is not measured yet in the bucket, else speculating when the
    rows' mean expected tokens per step, 1 + gain, exceed the cost ratio, speculating seconds over
    plain seconds per step. Engine thread only."""

    STRETCH = 8
    TRANSITION = 2
    ALPHA = 0.3
    GAIN_ALPHA = 0.1
    """A request's gain moves this share toward each speculating step's count: slowly, since a run
    of rejected drafts is common inside copyable text, and wrongly stopping costs more than wrongly
    going on (on 2 Zen 4 cores a speculating step of SmolLM2 cost 1.14 plain ones at batch 1)."""
    PRIOR = 1.0
    RECOVER = 0.03

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.seconds: dict[tuple[int, bool], float] = {}
        """(bucket, speculating) -> seconds per decode step (moving average)."""
        self._gain: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._stretch: tuple[int, bool] | None = None
        self._steps, self._timed, self._seconds = 0, 0, 0.0
        self._last: float | None = None

    def gain(self, req) -> float:
        """Drafts ``req`` is expected to have accepted per speculating step."""
        return self._gain.get(req, self.PRIOR)

    def accepted(self, req, n: int) -> None:
        """``req`` had ``n`` drafts accepted in a speculating step (0: it got no draft)."""
        old = self._gain.get(req, self.PRIOR)
        self._gain[req] = old + self.GAIN_ALPHA * (n - old)

    def speculate(self, reqs: list) -> bool:
        """Whether a step decoding ``reqs`` speculates (the running stretch's kind, or a new
        stretch's when it ended or the batch changed bucket)."""
        bucket = (len(reqs) - 1).bit_length()
        if self._stretch is not None and self._stretch[0] == bucket and self._steps < self.STRETCH:
            return self._stretch[1]
        self._close()
        fast, plain = self.seconds.get((bucket, True)), self.seconds.get((bucket, False))
        if fast is None or plain is None:
            kind = fast is None
        else:
            kind = sum(1 + self.gain(r) for r in reqs) / len(reqs) * plain > fast
        if not kind:
            for r in reqs:
                self._gain[r] = self.gain(r) + self.RECOVER * (self.PRIOR - self.gain(r))
        self._stretch, self._steps, self._timed, self._seconds = (bucket, kind), 0, 0, 0.0
        return kind

    def record(self, rows: int) -> None:
        """A decode step of ``rows`` rows ended (``rows`` = 0: a step with prefill, which only
        restarts the clock). It counts for the running stretch when in its bucket."""
        now = self.clock()
        last, self._last = self._last, now
        if not rows or self._stretch is None or self._stretch[0] != (rows - 1).bit_length():
            return
        self._steps += 1
        if self._steps > self.TRANSITION and last is not None:
            self._timed += 1
            self._seconds += now - last

    def _close(self) -> None:
        """Fold the ended stretch's seconds per step into its kind's average."""
        if self._stretch is None or not self._timed:
            return
        seconds = self._seconds / self._timed
        old = self.seconds.get(self._stretch)
        self.seconds[self._stretch] = seconds if old is None else old + self.ALPHA * (seconds - old)


class Speculator:
    """Drafts for a step's decode chunks, and the verification of a step with verify chunks."""

    def __init__(self, config: SpeculativeConfig, scheduler: Scheduler, max_batch_tokens: int, runner=None,
                 tokenizer=None, version: Callable[[], int] = lambda: 0) -> None:
        if config.method not in ("ngram", "mlp"):
            raise ValueError(f"engine.speculative.method must be ngram or mlp here, got {config.method!r}")
        self.config = config
        self.scheduler = scheduler
        self.max_batch_tokens = max_batch_tokens
        self._index: weakref.WeakKeyDictionary[Req, NgramIndex] = weakref.WeakKeyDictionary()
        self.drafter: MlpDrafter | None = None
        """The mlp drafter (``noria.engine.drafter``), or None for ngram."""
        self._hidden: dict[int, tuple[Req, dict[int, torch.Tensor]]] = {}
        """mlp: per request, token position -> the hidden state that produced the token there."""
        if runner is not None and runner.graphs is not None and config.method == "mlp":
            log.warning("engine.speculative.method mlp on CUDA: decode steps replayed from CUDA graphs give no hidden states, so the "
                        "drafter never learns or drafts there and the engine decodes plainly; it is a CPU engine's option for now")
        elif runner is not None and runner.graphs is not None:
            log.warning("engine.speculative.method %s on CUDA: its verify steps run eagerly while plain decode steps replay CUDA graphs, "
                        "so speculating rows (at most engine.speculative.max_batch=%d running) decode slower, not faster (0.07-0.18x "
                        "at batch 1 on an H100 with policy: always, docs/engines.md; policy: measured stops speculating there once "
                        "measured); it is a CPU engine's option for now", config.method, config.max_batch)
        if config.method == "mlp":
            self.drafter = MlpDrafter(runner.model, config, tokenizer)
            if runner.graphs is None:  # with CUDA graphs it would learn from the eager steps alone, and draft at few
                runner.on_hidden = self.observe
        self._version = version
        self.policy = SpeedPolicy() if config.policy == "measured" else None
        """Measures which kind of step is faster per batch size (None: ``policy: always``)."""
        self._fell_back: tuple[int, int] | None = None
        """(weight version, drafter rounds) when speculation fell back to plain decoding, else None."""
        self._window = [0, 0]  # drafted, accepted since the acceptance was last judged
        self._skipped = 0  # steps without speculation since it fell back
        self.fallbacks = 0
        """Times speculation fell back to plain decoding (``min_acceptance``)."""
        self.proposed = 0
        """Draft tokens verified so far."""
        self.accepted = 0
        """Draft tokens accepted so far."""
        self.verify_rows = 0
        """Verify chunks so far (one per drafted request per step)."""
        self.verify_tokens = 0
        """Tokens those verify chunks produced (accepted drafts plus the one sampled after them)."""
        self.verify_steps = 0
        """Forward steps with at least one verify chunk."""

    @staticmethod
    def _decoding(chunks: list[Chunk]) -> list[Chunk]:
        return [c for c in chunks if c.n == 1 and c.sample and not c.pending]

    def active(self, chunks: list[Chunk]) -> bool:
        """Whether the step after ``chunks`` may speculate (:meth:`small_batch`, a drafter that can
        draft, no fallback): then the engine schedules it on the host rather than overlapping it."""
        ready = self.drafter is None or self.drafter.ready
        if not (ready and self.small_batch() and not self.falling_back()):
            return False
        return self.policy is None or self.policy.speculate(list(self.scheduler.running))

    def small_batch(self) -> bool:
        """At most ``max_batch`` requests running or waiting: a batch that is still being admitted
        counts whole (its first rows would otherwise speculate, and stop the engine overlapping
        steps, until the rest joins)."""
        return len(self.scheduler.running) + len(self.scheduler.waiting) <= self.config.max_batch

    def _epoch(self) -> tuple[int, int]:
        """(weight version, drafter rounds): a fallback lasts while neither moves."""
        return self._version(), self.drafter.rounds if self.drafter else 0

    def falling_back(self) -> bool:
        """Whether speculation is off for low acceptance: until the drafter's next training round or
        the next weight version (``min_acceptance``), or for 512 steps."""
        if self._fell_back is None:
            return False
        if self._fell_back != self._epoch() or self._skipped > 512:
            self._fell_back = None  # and after 512 steps without speculation, try again
        return self._fell_back is not None

    def propose(self, chunks: list[Chunk], generator: torch.Generator | None = None) -> bool:
        """Turn the step's eligible decode chunks into verify chunks (drafts attached, blocks
        allocated); True when at least one was. ``generator``: the engine's, for the draws of a
        sampled mlp draft of an unseeded request."""
        decoding = self._decoding(chunks)
        if self._fell_back is not None:
            self._skipped += 1
        if not decoding or not self.small_batch() or self.falling_back():  # prefilling and waiting ones will decode soon
            return False
        if any(c.req.routes is not None or c.req.request.top_logprobs_num > 0 for c in chunks if c.sample):
            return False
        if scoring.score_rows(chunks):
            return False
        if self.policy is not None and not self.policy.speculate([c.req for c in decoding]):
            return False
        budget = min(self.max_batch_tokens - sum(c.n for c in chunks), self.config.draft_budget)
        drafts = self._mlp_drafts(decoding, generator) if self.drafter is not None else None
        drafted = False
        for c in decoding:
            if budget <= 0:
                break
            k = self._room(c.req, budget)
            proposal = drafts.get(id(c.req)) if drafts is not None else None
            if drafts is not None:
                draft = proposal.tokens[:k] if proposal is not None else []
            else:
                draft = self._ngram_draft(c.req, k) if k > 0 else []
            draft = self._fit(c, draft)
            if draft:
                c.draft = draft
                if proposal is not None and proposal.q is not None:
                    c.draft_q = proposal.q[: len(draft)]
                c.n = 1 + len(draft)
                budget -= len(draft)
                drafted = True
            elif self.policy is not None and k > 0:
                self.policy.accepted(c.req, 0)  # speculating, and nothing to verify for it
        return drafted

    def _room(self, req: Req, budget: int) -> int:
        """Draft tokens ``req`` may take: the verify step emits up to len(draft) + 1 tokens, never
        past max_new_tokens or the context."""
        room = min(req.request.sampling.max_new_tokens - len(req.output_ids), req.max_total_tokens - len(req.all_ids))
        return min(self.config.num_tokens, budget, room - 1)

    def _ngram_draft(self, req: Req, k: int) -> list[int]:
        index = self._index.get(req)
        if index is None:
            index = self._index[req] = NgramIndex(self.config.ngram_min, self.config.ngram_max)
        return index.draft(req.all_ids, k)

    def _fit(self, c: Chunk, draft: list[int]) -> list[int]:
        """``draft`` cut to the KV blocks the request can get (allocated here)."""
        if not draft:
            return draft
        req = c.req
        bs = self.scheduler.kv.block_size
        need = -(-(c.start + 1 + len(draft)) // bs) - len(req.block_table)
        if not self.scheduler._allocate_into(req, need):  # no free blocks: draft what the table holds
            draft = draft[: len(req.block_table) * bs - c.start - 1]
        return draft

    # ------------------------------------------------------------------------------ the mlp drafter

    def _mlp_drafts(self, decoding: list[Chunk], generator: torch.Generator | None) -> dict[int, Draft]:
        """mlp: ``num_tokens`` drafts per decoding request whose last token's hidden state is known,
        in one batched call of the drafter; by id(request). A sampled request's draft is drawn with
        uniforms from its own generator when seeded, else from ``generator``."""
        if not self.drafter.ready:
            return {}
        reqs, hidden = [], []
        for c in decoding:
            entry = self._hidden.get(id(c.req))
            h = entry[1].get(len(c.req.all_ids) - 1) if entry is not None else None
            if h is not None:
                reqs.append(c.req)
                hidden.append(h)
        if not reqs:
            return {}
        k = self.config.num_tokens
        uniforms = torch.tensor([self._uniforms(r, k, generator) for r in reqs])
        drafts = self.drafter.propose(torch.stack(hidden), [r.all_ids[-1] for r in reqs], k, [r.request.sampling for r in reqs],
                                      uniforms)
        return {id(r): d for r, d in zip(reqs, drafts)}

    def observe(self, chunks: list[Chunk], hidden: torch.Tensor) -> None:
        """The runner's hook after a forward: ``hidden`` [rows, H] are the final states of the
        sampling chunks' last rows, then of the verify chunks' draft rows; each is recorded at the
        position of the token it gives (a rejected draft's is overwritten by a later step)."""
        row, extra = 0, sum(c.sample for c in chunks)
        for c in chunks:
            if not c.sample:
                continue
            req, base = c.req, len(c.req.all_ids)
            entry = self._hidden.get(id(req))
            if entry is None:
                entry = self._hidden[id(req)] = (req, {})
            positions = entry[1]
            for i in range(len(c.draft)):
                positions[base + i] = hidden[extra + i]
            positions[base + len(c.draft)] = hidden[row]
            extra += len(c.draft)
            row += 1

    def after_step(self, chunks: list[Chunk]) -> None:
        """After the engine recorded a step's tokens (weights live): the step's speed goes to the
        policy, and every finished request's output to the drafter's training buffer."""
        if self.policy is not None:  # (the tokens are appended now: a decode chunk is one past the prompt)
            decode = all(c.start >= c.req.prompt_len and (c.n == 1 or c.draft) for c in chunks)
            self.policy.record(len(chunks) if decode else 0)
        if self.drafter is None:
            return
        for key, (req, positions) in list(self._hidden.items()):
            if req.state is not ReqState.FINISHED:
                continue
            del self._hidden[key]
            n = 0
            for p in range(req.prompt_len, len(req.all_ids)):  # the run of known states from the first output token
                if p not in positions:
                    break
                n += 1
            if n >= 2:
                first = req.prompt_len
                self.drafter.add(torch.stack([positions[p] for p in range(first, first + n)]), req.all_ids[first : first + n])

    def train_slice(self) -> bool:
        """One optimizer step of the drafter when a round is due (the engine calls this while it
        has no request); False when there was none."""
        if self.drafter is None or not self.drafter.train_due():
            return False
        self.drafter.train_step()
        return True

    # ------------------------------------------------------------------------------ verify

    def run(self, runner, chunks: list[Chunk], generator: torch.Generator | None, deterministic: bool):
        """Forward and sample a step with verify chunks: (ids, logprobs, top) per sampling chunk,
        in chunk order, as ``Scheduler.process`` takes them (a list of tokens for a verify chunk)."""
        extra, offset = [], 0
        for c in chunks:
            if c.draft:
                extra.extend(range(offset, offset + len(c.draft)))  # the rows that verify the draft
            offset += c.n
        last, drafts = runner.forward_scoring(chunks, extra)
        sampling = [c for c in chunks if c.sample]
        ids: list = [None] * len(sampling)
        logprobs: list = [None] * len(sampling)
        top: list | None = None
        plain = [i for i, c in enumerate(sampling) if not c.draft]
        if plain:
            reqs = [sampling[i].req for i in plain]
            k = max(r.request.top_logprobs_num for r in reqs)
            rows = torch.tensor(plain, device=last.device)
            res = sample(last.index_select(0, rows), [r.request.sampling for r in reqs], [r.generator for r in reqs],
                         generator, k, deterministic)
            for i, t, lp in zip(plain, res.token_ids.tolist(), res.logprobs.tolist()):
                ids[i], logprobs[i] = t, lp
            if res.top_ids is not None:
                top = [None] * len(sampling)
                for i, t, v in zip(plain, res.top_ids.tolist(), res.top_logprobs.tolist()):
                    top[i] = list(zip(t, v))
        verified = [i for i, c in enumerate(sampling) if c.draft]
        for i, (toks, lps) in zip(verified, self._verify([sampling[i] for i in verified], last, verified, drafts, generator)):
            ids[i], logprobs[i] = toks, lps
        self.verify_steps += 1
        return ids, logprobs, top

    def _verify(self, chunks: list[Chunk], last: torch.Tensor, last_rows: list[int], drafts: torch.Tensor,
                generator: torch.Generator | None) -> list[tuple[list[int], list[float]]]:
        """Accept or reject each verify chunk's draft; (tokens, logprobs) per chunk. A draft token d
        drawn from q (``Chunk.draft_q``; a point mass for n-gram and greedy drafts) is accepted with
        probability min(1, p(d) / q(d)); at the first rejection the token is drawn from
        max(0, p - q), renormalised: exact speculative sampling (Leviathan et al., 2023)."""
        pieces, params, offset = [], [], 0
        for c, row in zip(chunks, last_rows):
            k = len(c.draft)
            pieces += [drafts[offset : offset + k], last[row : row + 1]]
            params += [c.req.request.sampling] * (k + 1)
            offset += k
        logits = torch.cat(pieces).float()
        device = logits.device
        logp = log_softmax_rows(logits, params)
        weights = processed_weights(logits, params)
        argmax = logits.argmax(dim=-1)
        targets = torch.tensor([t for c in chunks for t in c.draft + [0]], device=device)
        p_draft = (weights.gather(1, targets.unsqueeze(1)).squeeze(1) / weights.sum(dim=-1)).tolist()
        q_draft = self._draft_probabilities(chunks)
        argmax_h = argmax.tolist()
        uniforms = [self._uniforms(c.req, len(c.draft) + 1, generator) for c in chunks]
        finals, final_rows, rejected, start = [], [], [], 0
        for c, u in zip(chunks, uniforms):
            greedy, k = c.req.request.sampling.greedy, len(c.draft)
            a = 0
            while a < k and (argmax_h[start + a] == c.draft[a] if greedy else u[a] * q_draft[start + a] < p_draft[start + a]):
                a += 1
            finals.append(a)
            final_rows.append(start + a)
            rejected.append(c.draft[a] if a < k else -1)
            start += k + 1
        rows = torch.tensor(final_rows, device=device)
        w = weights.index_select(0, rows)
        for i, (c, a) in enumerate(zip(chunks, finals)):
            if a == len(c.draft):
                continue  # all accepted: the bonus token comes from p itself
            if c.draft_q is None:  # the rejected draft token has no mass in its row's resample
                w[i, rejected[i]] = 0.0
            else:
                residual = (w[i] / w[i].sum()).index_add(0, self.drafter.vocab, -c.draft_q[a].to(device)).clamp_(min=0.0)
                if residual.sum() > 0:  # zero only where p == q to rounding, when rejecting had no chance
                    w[i] = residual
        drawn = inverse_cdf(w, torch.tensor([u[-1] for u in uniforms], device=device)).tolist()
        out, start = [], 0
        for j, (c, a) in enumerate(zip(chunks, finals)):
            last_token = argmax_h[final_rows[j]] if c.req.request.sampling.greedy else drawn[j]
            tokens = c.draft[:a] + [last_token]
            chosen = torch.tensor(tokens, device=device)
            lps = logp[start : start + a + 1].gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
            out.append((tokens, lps))
            self.proposed += len(c.draft)
            self.accepted += a
            self._judge(len(c.draft), a)
            if self.policy is not None:
                self.policy.accepted(c.req, a)
            self.verify_rows += 1
            self.verify_tokens += a + 1
            start += len(c.draft) + 1
        return out

    def _draft_probabilities(self, chunks: list[Chunk]) -> list[float]:
        """q(d) of every draft token, flattened as the verify rows are (a point mass's is 1; each
        chunk's bonus row gets 1 too, never read)."""
        out = []
        for c in chunks:
            if c.draft_q is None:
                out += [1.0] * (len(c.draft) + 1)
                continue
            vocab = self.drafter.vocab
            slot = torch.searchsorted(vocab, torch.tensor(c.draft, device=vocab.device))  # the vocabulary is sorted
            out += c.draft_q.gather(1, slot.to(c.draft_q.device).unsqueeze(1)).squeeze(1).tolist() + [1.0]
        return out

    def _judge(self, drafted: int, accepted: int) -> None:
        """Fall back to plain decoding when a window of >= 64 drafted tokens accepted fewer than
        ``min_acceptance`` of them. Only with ``policy: always``: the measured policy weighs each
        request's own acceptance against the measured cost of a step instead."""
        if self.policy is not None:
            return
        self._window[0] += drafted
        self._window[1] += accepted
        if self._window[0] >= 64:
            if self._window[1] < self.config.min_acceptance * self._window[0]:
                self._fell_back = self._epoch()
                self._skipped = 0
                self.fallbacks += 1
            self._window = [0, 0]

    @staticmethod
    def _uniforms(req: Req, n: int, shared: torch.Generator | None) -> list[float]:
        """n uniforms of one verify chunk (k acceptance tests, then the final draw), from the
        request's generator when seeded, else the engine's; none drawn for a greedy request."""
        if req.request.sampling.greedy:
            return [0.0] * n
        gen = req.generator if req.generator is not None else shared
        return torch.rand(n, generator=gen, device=gen.device if gen is not None else "cpu").tolist()

    def metrics(self) -> dict[str, float]:
        """Cumulative counters since start; differences between two reads give an interval's rates."""
        return {
            "spec_proposed_tokens": self.proposed,
            "spec_accepted_tokens": self.accepted,
            "spec_verify_rows": self.verify_rows,
            "spec_verify_tokens": self.verify_tokens,
            "spec_verify_steps": self.verify_steps,
            "spec_acceptance": self.accepted / self.proposed if self.proposed else 0.0,
            "spec_tokens_per_verify": self.verify_tokens / self.verify_rows if self.verify_rows else 0.0,
            "spec_fallbacks": self.fallbacks,
            **({} if self.drafter is None else {
                "spec_drafter_loss": self.drafter.loss, "spec_drafter_steps": self.drafter.steps,
                "spec_drafter_rounds": self.drafter.rounds, "spec_drafter_train_s": self.drafter.train_s,
            }),
        }
