"""Request states and continuous batching: what each forward step computes.

A request is WAITING (queued, no KV), RUNNING (admitted; holds a block table) or FINISHED. Every
step ``schedule`` builds one batch of :class:`Chunk` s, each "compute tokens [start, start+n) of
this request", in this order:

1. decode: every running request whose prompt is fully computed gets its next token (n = 1);
2. prefill: running requests still prefilling get their next chunk (``chunked_prefill_size``);
3. admission: waiting requests join at the front of the queue first, each with a prefix-cache
   match and a first chunk, while ``max_running_requests`` and ``max_batch_tokens`` allow. The queue
   is ordered by ``GenerateRequest.priority`` (higher first; FIFO among equals), so a judge sharing
   the engine at a lower priority is admitted only when no rollout request waits. A
   match is token-granular (``noria.engine.radix``): when it ends inside a block, the matched
   slots of that block are copied into the request's first new block before its first chunk runs
   (``KVCache.copy_prefix``, on the engine thread, queued before the step's forward).
   In-batch prefix caching (as SGLang's scheduler does): a waiting request whose next uncached
   full block is one a running request is still prefilling stays in its place in the queue, and
   requests behind it go first; each prefill chunk offers its full blocks to the prefix cache at
   once (not only when its request ends), so the request waits one step and then matches them. An
   RL step submits a group's samples together: their prompt is computed once, not once per sample
   (1.8x tokens/s for 8 prompts x 8 samples of the main job's model, ``noria bench engine --group 8``).

With ``engine.overlap`` the engine asks ``follow`` for the next decode step before the current
one's tokens are known; ``follow`` returns exactly what ``schedule`` would (or None), its chunks
marked ``pending``, and ``process`` drops the result of a pending chunk whose request finished.

Memory. Blocks are allocated as sequences grow. When the allocator runs dry, the prefix cache
evicts unreferenced blocks first; if that is not enough, the most recently admitted running
request not yet scheduled this step is RETRACTED: its KV is offered to the prefix cache, its blocks
are released, and it goes back to the front of the queue (of its priority) keeping its output so far; a
request of the lowest priority is retracted before any of a higher one. Re-admitted,
it prefills prompt + output and continues, so its final output is one uninterrupted sequence.
Admission never retracts anyone. The oldest running request can always make progress, because
no request larger than the whole cache is accepted (the engine checks at submit).

Deterministic mode aligns prefill chunks to multiples of ``chunked_prefill_size`` from position 0
(a chunk waits rather than shrink to the step's leftover budget), so a request's chunks have the
same shapes whatever else runs. Prefix matches are not cut to that grid: the exact numerics give a
token the same bits however its prompt is chunked, and copied K/V are the cached bits, so a
request served from a (partly) cached prefix gets the logprobs of one computed from scratch
(tests/engine/test_prefix_tokens.py).

Blocking: none; everything here runs on the engine's step thread. There is no device code here:
the runner turns chunks into a forward. Not guaranteed: FIFO order among waiting requests once
retractions put requests back at the front; deterministic results across a retraction.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from noria.config import EngineConfig
from noria.engine import vision
from noria.engine.kv_cache import KVCache
from noria.engine.protocol import GenerateOutput, GenerateRequest
from noria.engine.radix import RadixCache


class ReqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    """One request inside the engine: its tokens so far, its KV blocks and its outputs."""

    request: GenerateRequest
    callback: Callable[[GenerateOutput], None]
    stream: bool
    max_total_tokens: int
    """Prompt + output never exceed this (min of prompt + max_new_tokens and the context limit)."""
    generator: torch.Generator | None = None
    all_ids: list[int] = field(default_factory=list)
    """Prompt followed by every sampled token."""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    routes: list[torch.Tensor] | None = None
    """With ``return_routed_experts``: per output token, the [L, k] experts of the step that
    sampled it (appended then, never recomputed: a re-prefill after a retraction leaves them)."""
    state: ReqState = ReqState.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Tokens of all_ids whose K/V are in the cache."""
    cached_tokens: int = 0
    admitted_order: int = -1
    admissions: int = 0
    epoch: int = 0
    """Prefix-cache epoch at admission; KV from an older epoch is never cached."""
    finish_reason: dict[str, Any] | None = None
    input_logprobs: list[float | None] | None = None
    """Prefill scoring (``logprob_start_len``; ``noria.engine.scoring``): logprobs of the input
    tokens from that position on, filled in position order."""
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    lora: Any = None
    """The request's LoRA adapter (``noria.engine.lora.Adapter``, pinned by the engine while the
    request lives), or None for the base model."""
    namespace: int | None = None
    """Prefix-cache namespace at admission (the adapter's ``key``; None: the base model's)."""
    block_keys: tuple[tuple[int, object], list[int]] | None = None
    """``Scheduler._block_keys``' last answer, with the (length, namespace) it was made for."""

    def __post_init__(self) -> None:
        self.all_ids = list(self.request.input_ids)
        if self.request.top_logprobs_num > 0:
            self.top_logprobs = []
        if self.request.scores_input:
            first = [None] if self.request.logprob_start_len == 0 else []  # position 0 has no logprob
            self.input_logprobs = list(first)
            if self.request.top_logprobs_num > 0:
                self.input_top_logprobs = list(first)
        if self.request.return_routed_experts:
            self.routes = []

    @property
    def rid(self) -> str:
        return self.request.rid

    @property
    def prompt_len(self) -> int:
        return len(self.request.input_ids)

    @property
    def scoring_from(self) -> int | None:
        """The position whose logits score the next unscored input token; None when none is left."""
        if self.input_logprobs is None:
            return None
        q = self.request.logprob_start_len + len(self.input_logprobs) - 1
        return q if q < self.prompt_len - 1 else None

    def cache_ids(self) -> list[int]:
        """``all_ids`` as the prefix cache keys them: image placeholders keyed by the images'
        content (``noria.engine.vision.cache_ids``)."""
        return vision.cache_ids(self.all_ids, self.request.images) if self.request.images else self.all_ids

    @property
    def remaining(self) -> int:
        """Tokens to compute before the next sample."""
        return len(self.all_ids) - self.num_computed

    def output(self, text: str = "") -> GenerateOutput:
        return GenerateOutput(
            rid=self.rid,
            output_ids=list(self.output_ids),
            logprobs=list(self.logprobs),
            weight_versions=list(self.versions),
            top_logprobs=None if self.top_logprobs is None else list(self.top_logprobs),
            text=text,
            finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_len,
            cached_tokens=self.cached_tokens,
            input_ids=list(self.request.input_ids) if self.input_logprobs is not None else [],
            input_logprobs=None if self.input_logprobs is None else list(self.input_logprobs),
            input_top_logprobs=None if self.input_top_logprobs is None else list(self.input_top_logprobs),
            routed_experts=torch.stack(self.routes) if self.routes else None,
            adapter=self.request.adapter,
            adapter_version=None if self.lora is None else self.lora.version,
        )


@dataclass
class Chunk:
    """Compute ``n`` tokens of ``req`` starting at position ``start``; sample after it if ``sample``.

    A ``pending`` chunk (:meth:`Scheduler.follow`) decodes the token the step before it samples,
    scheduled before that token reached the host: its id is fed on the device, or set as ``token``
    by the engine when the previous step's result is on the host already."""

    req: Req
    start: int
    n: int
    pending: bool = False
    token: int | None = None
    draft: list[int] = field(default_factory=list)
    """Speculative decoding (``noria.engine.speculative``): tokens proposed after the request's
    last one, computed in this chunk (its last ``len(draft)`` tokens) and verified by its logits."""
    draft_q: Any = None
    """A sampled draft's distributions, q [len(draft), Vd] over the mlp drafter's vocabulary: each
    draft token was drawn from its row (``noria.engine.drafter``); None for a point-mass draft."""

    @property
    def sample(self) -> bool:
        return self.pending or self.start + self.n - len(self.draft) == len(self.req.all_ids)

    @property
    def token_ids(self) -> list[int]:
        if self.pending:
            if self.token is None:
                raise RuntimeError(f"pending chunk of {self.req.rid} read on the host before its token was set")
            return [self.token]
        return self.req.all_ids[self.start : self.start + self.n - len(self.draft)] + self.draft

    @property
    def block_table(self) -> list[int]:
        return self.req.block_table


class StopChecker:
    """Finish conditions of the engine: EOS ids, stop token ids, stop strings, lengths."""

    def __init__(self, eos_ids: set[int], tokenizer: Any | None) -> None:
        self.eos_ids = eos_ids
        self.tokenizer = tokenizer

    def check(self, req: Req) -> dict[str, Any] | None:
        """The finish reason after ``req``'s newest token, or None to continue."""
        params, token = req.request.sampling, req.output_ids[-1]
        if not params.ignore_eos and token in self.eos_ids:
            return {"type": "stop", "matched": token}
        if token in params.stop_token_ids:
            return {"type": "stop", "matched": token}
        matched = self._stop_string(req)
        if matched is not None:
            return {"type": "stop", "matched": matched}
        if len(req.output_ids) >= params.max_new_tokens or len(req.all_ids) >= req.max_total_tokens:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def _stop_string(self, req: Req) -> str | None:
        stops = req.request.sampling.stop
        if not stops or self.tokenizer is None:
            return None
        # A stop string ending at the newest token lies within its last 4 * chars + 4 tokens
        # (a byte-level token carries at least one byte; a character at most four).
        window = 4 * max(len(s) for s in stops) + 4
        tail = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=True)
        return next((s for s in stops if s in tail), None)


class Scheduler:
    """Continuous batching over a paged KV cache; see the module docstring."""

    def __init__(self, config: EngineConfig, kv: KVCache, radix: RadixCache, stops: StopChecker) -> None:
        self.config = config
        self.kv = kv
        self.radix = radix
        self.stops = stops
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.paused: str | None = None
        self.retractions = 0
        self._order = itertools.count()
        self.partial_reuse = "copy"
        """How a match ending inside a block is served: ``copy`` (copy-on-write into a fresh block)
        or ``share`` (append in place to the cached partial block when nothing is written past the
        match there yet; else copy). Measured the same (docs/engines.md); ``noria bench prefix`` sets it."""
        self._appending: set[int] = set()
        """``share``: cached partial blocks a running request appends to in place."""
        share = config.prefix_cache_share if kv.lazy else 1.0
        self.cache_blocks = None if share >= 1 else int(share * kv.num_blocks)
        """Blocks the prefix cache holds before fresh ones are spared (``engine.prefix_cache_share``); None: no bound."""

    # ------------------------------------------------------------------------------ queue

    def add(self, req: Req) -> None:
        """Queue ``req`` behind every waiting request of its priority or higher (FIFO among equals)."""
        self._enqueue(req, front=False)

    def _enqueue(self, req: Req, front: bool) -> None:
        """Put ``req`` at the back (``front``: the front) of its priority's place in the queue: higher
        priorities first. With one priority (every request 0) this is append / appendleft."""
        p, waiting = req.request.priority, self.waiting
        if front and (not waiting or waiting[0].request.priority <= p):
            waiting.appendleft(req)
        elif not front and (not waiting or waiting[-1].request.priority >= p):
            waiting.append(req)
        else:  # before the first of its priority or lower (front), or of lower priority (back)
            waiting.insert(next((i for i, w in enumerate(waiting) if w.request.priority < p + front), len(waiting)), req)

    def abort(self, rid: str, message: str) -> Req | None:
        """Finish ``rid`` with reason abort, releasing its blocks; None if it is not in flight."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                return self._finish(req, {"type": "abort", "message": message})
        for req in self.running:
            if req.rid == rid:
                self._release(req)
                self.running.remove(req)
                return self._finish(req, {"type": "abort", "message": message})
        return None

    def abort_all(self, message: str) -> list[Req]:
        return [r for r in (self.abort(x.rid, message) for x in [*self.running, *self.waiting]) if r]

    def pause(self, mode: str) -> None:
        """``in_place``: stop scheduling, keep KV. ``retract``: also retract every running request."""
        self.paused = mode
        if mode == "retract":
            for req in sorted(self.running, key=lambda r: r.admitted_order, reverse=True):
                self._retract(req)

    def resume(self) -> None:
        self.paused = None

    @property
    def has_work(self) -> bool:
        return self.paused is None and bool(self.running or self.waiting)

    # ------------------------------------------------------------------------------ schedule

    def schedule(self) -> list[Chunk]:
        """The chunks of the next forward step (empty when paused or idle)."""
        if self.paused is not None:
            return []
        budget = self.config.max_batch_tokens
        chunks: list[Chunk] = []
        scheduled: set[int] = set()
        for decoding in (True, False):
            for req in list(self.running):
                if req.state is not ReqState.RUNNING or (req.remaining == 1) != decoding:
                    continue
                n = self._chunk_len(req, budget)
                if n and self._grow(req, n, scheduled, may_retract_self=decoding):
                    chunks.append(Chunk(req, req.num_computed, n))
                    scheduled.add(id(req))
                    budget -= n
        return chunks + self._admit(budget)

    def _chunk_len(self, req: Req, budget: int) -> int:
        size = self.config.chunked_prefill_size
        if self.config.deterministic:
            n = min(req.remaining, size - req.num_computed % size)
            return n if n <= budget else 0
        return max(0, min(req.remaining, size, budget))

    def _grow(self, req: Req, n: int, scheduled: set[int], may_retract_self: bool) -> bool:
        """Give ``req`` blocks for n more tokens, retracting newer requests if needed."""
        need = self._blocks_needed(req, n)
        while not self._allocate_into(req, need):
            victims = [r for r in self.running if id(r) not in scheduled]
            victim = max(victims, key=lambda r: (-r.request.priority, r.admitted_order))  # lowest priority, then newest
            if victim is req and not may_retract_self:
                return False  # a prefill waits for decodes to free blocks rather than thrash
            self._retract(victim)
            if victim is req:
                return False
        return True

    def _admit(self, budget: int) -> list[Chunk]:
        chunks, deferred = [], []
        pending = self._pending_blocks()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            namespace = None if req.lora is None else req.lora.key  # adapters never share KV
            limit = self._match_limit(req)
            match = self.radix.match_prefix(req.cache_ids(), limit, namespace)
            keys = self._block_keys(req, namespace) if self.radix.enabled else []  # no cache: nothing to wait for
            following = match.tokens // self.kv.block_size
            if match.tokens < limit and following < len(keys) and keys[following] in pending:
                self.radix.unlock(match)  # its next block is being computed by another request: match it next step
                deferred.append(self.waiting.popleft())
                if len(deferred) >= self.config.max_running_requests:
                    break  # no use looking further this step
                continue
            req.block_table, req.num_computed = list(match.blocks), match.tokens
            shared = self._share_partial(req, match)
            n = self._chunk_len(req, budget)
            if n == 0 or not self._allocate_into(req, self._blocks_needed(req, n)):
                self._appending.discard(shared)
                self.radix.unlock(match)
                req.block_table, req.num_computed = [], 0
                break
            if match.partial_block is not None and shared is None:  # copy-on-write
                self.kv.copy_prefix(match.partial_block, req.block_table[len(match.blocks)], match.partial_tokens)
                self.kv.allocator.decref([match.partial_block])
            self.waiting.popleft()
            self._start(req, match.tokens)
            req.namespace = namespace
            if req.remaining > 1:  # prefilling: what it computes is cached as it goes (_cache_full_blocks)
                pending.update(keys[req.num_computed // self.kv.block_size :])
            chunks.append(Chunk(req, req.num_computed, n))
            budget -= n
        self.waiting.extendleft(reversed(deferred))  # in their places: ahead of everything not yet looked at
        return chunks

    def _block_keys(self, req: Req, namespace: object) -> list[int]:
        """One key per full KV block of ``req``'s tokens: a hash of the namespace and every token up
        to the block's end (two requests' keys at a block are equal exactly when their prefixes
        there are, but for hash collisions, which only cost a deferral)."""
        ids, bs = req.cache_ids(), self.kv.block_size
        if req.block_keys is not None and req.block_keys[0] == (len(ids), namespace):
            return req.block_keys[1]
        keys, h = [], hash(namespace)
        for end in range(bs, len(ids) + 1, bs):
            h = hash((h, tuple(ids[end - bs : end])))
            keys.append(h)
        req.block_keys = ((len(ids), namespace), keys)
        return keys

    def _pending_blocks(self) -> set[int]:
        """Keys of the full blocks running requests still have to prefill (this step or later): a
        waiting request whose next uncached block is one of them is admitted only once that block
        is computed and cached (SGLang's in-batch prefix caching), so a group's samples, submitted
        together, prefill their prompt once rather than once each."""
        if not self.radix.enabled:
            return set()
        pending: set[int] = set()
        for req in self.running:
            if req.remaining > 1:
                pending.update(self._block_keys(req, req.namespace)[req.num_computed // self.kv.block_size :])
        return pending

    def _share_partial(self, req: Req, match) -> int | None:
        """``share``: put the match's partial block itself in ``req``'s table (the match's reference
        becomes the request's) when the match covers every token written there and no other
        request appends to it; returns that block, else None (the caller copies)."""
        block = match.partial_block
        if self.partial_reuse != "share" or block is None or block in self._appending:
            return None
        if match.partial_fill != match.partial_tokens:
            return None
        self._appending.add(block)
        req.block_table.append(block)
        return block

    def _match_limit(self, req: Req) -> int:
        limit = len(req.all_ids) - 1
        if req.scoring_from is not None:  # positions still to score are computed, not matched
            limit = min(limit, req.scoring_from)
        return limit

    def _start(self, req: Req, cached: int) -> None:
        if req.admissions == 0:
            req.cached_tokens = cached
            self.radix.record_hit(req.prompt_len, min(cached, req.prompt_len))
        req.admissions += 1
        req.state = ReqState.RUNNING
        req.admitted_order = next(self._order)
        req.epoch = self.radix.epoch
        self.running.append(req)

    def follow(self, chunks: list[Chunk]) -> list[tuple[int, Chunk]] | None:
        """The next decode step, scheduled while ``chunks`` (a step of decode chunks of every running
        request) still runs: (row in ``chunks``, pending chunk) for each request that continues
        unless the token being sampled stops it, with its block for that token allocated. A request
        that the step's token finishes by length is left out; one that a stop token finishes is
        decoded once more and its result dropped (:meth:`process`). This is what :meth:`schedule`
        would return once the step is processed, provided nothing waits or is paused (the caller
        checks); None when that does not hold or blocks are short (no retraction here)."""
        # Pending chunks of requests finished since (their dropped results) are not continued.
        live = [(row, c) for row, c in enumerate(chunks) if not (c.pending and c.req.state is not ReqState.RUNNING)]
        if self.paused is not None or self.waiting or len(live) != len(self.running):
            return None
        follow = []
        for row, c in live:
            req = c.req
            if c.n != 1 or not c.sample or req.state is not ReqState.RUNNING:
                return None
            if len(req.output_ids) + 1 >= req.request.sampling.max_new_tokens or len(req.all_ids) + 1 >= req.max_total_tokens:
                continue
            need = -(-(c.start + 2) // self.kv.block_size) - len(req.block_table)
            if not self._allocate_into(req, need):
                return None
            follow.append((row, Chunk(req, c.start + 1, 1, pending=True)))
        return follow or None

    # ------------------------------------------------------------------------------ blocks

    def _blocks_needed(self, req: Req, n: int) -> int:
        return -(-(req.num_computed + n) // self.kv.block_size) - len(req.block_table)

    def _allocate_into(self, req: Req, need: int) -> bool:
        if need <= 0:
            return True
        allocator = self.kv.allocator
        if self.cache_blocks is not None:  # the cache's written blocks before fresh ones, past its share
            fresh, over = need - allocator.num_written_free_blocks, self.radix.num_cached_blocks - self.cache_blocks
            if fresh > 0 and over > 0:
                self.radix.evict(min(fresh, over))
        if allocator.num_free_blocks < need:
            self.radix.evict(need - allocator.num_free_blocks)
        if allocator.num_free_blocks < need:
            return False
        req.block_table.extend(allocator.allocate(need))
        return True

    def _cache_full_blocks(self, req: Req) -> None:
        """Offer the full blocks prefilled so far to the prefix cache while ``req`` runs on: requests
        deferred behind them (``_admit``) match them at their next admission. Full blocks only: the
        partly written last block is still written, and a cached block never is."""
        full = req.num_computed // self.kv.block_size * self.kv.block_size
        self.radix.insert(req.cache_ids()[:full], req.block_table, req.epoch, req.namespace)

    def _release(self, req: Req) -> None:
        """Offer the computed KV to the prefix cache, then drop the request's block references."""
        self.radix.insert(req.cache_ids()[: req.num_computed], req.block_table, req.epoch, req.namespace)
        if self._appending:
            self._appending.difference_update(req.block_table)
        self.kv.allocator.decref(req.block_table)
        req.block_table, req.num_computed = [], 0

    def _retract(self, req: Req) -> None:
        self._release(req)
        self.running.remove(req)
        req.state = ReqState.WAITING
        self._enqueue(req, front=True)
        self.retractions += 1

    def _finish(self, req: Req, reason: dict[str, Any]) -> Req:
        req.finish_reason = reason
        req.state = ReqState.FINISHED
        return req

    # ------------------------------------------------------------------------------ results

    def process(
        self,
        chunks: list[Chunk],
        token_ids: list[int],
        logprobs: list[float],
        top: list[list[tuple[int, float]]] | None,
        version: int,
        routes: torch.Tensor | None = None,
    ) -> list[Req]:
        """Record a step's samples (in the order of the sampling chunks; ``routes`` [S, L, k] on the
        host when a request of the step asked for them); return requests to notify."""
        notify, row = [], 0
        for chunk in chunks:
            req = chunk.req
            if chunk.pending and req.state is not ReqState.RUNNING:
                row += 1  # the step before this one finished it (a stop token): drop this result
                continue
            # A verify chunk's K/V count up to its last accepted draft token; the rest is overwritten later.
            req.num_computed += chunk.n - len(chunk.draft) + (len(token_ids[row]) - 1 if chunk.draft else 0)
            if not chunk.draft and (chunk.n > 1 or req.remaining > 0) and req.num_computed >= self.kv.block_size:  # prefill
                self._cache_full_blocks(req)
            if not chunk.sample:
                continue
            if req.request.sampling.max_new_tokens == 0:  # prefill scoring only: nothing is generated
                row += 1
                self._release(req)
                self.running.remove(req)
                notify.append(self._finish(req, {"type": "length", "length": 0}))
                continue
            if chunk.draft:
                reason = self._append_verified(req, token_ids[row], logprobs[row], version)
                row += 1
            else:
                self._append(req, token_ids[row], logprobs[row], None if top is None else top[row], version)
                if req.routes is not None:
                    req.routes.append(routes[row].clone())  # a row of its own, not a view of the step's
                row += 1
                reason = self.stops.check(req)
            if reason is not None:
                self._release(req)
                self.running.remove(req)
                notify.append(self._finish(req, reason))
            elif req.stream:
                notify.append(req)
        return notify

    def _append_verified(self, req: Req, tokens: list[int], logprobs: list[float], version: int) -> dict[str, Any] | None:
        """A verify chunk's tokens, one by one, up to the first that finishes the request (its
        finish reason; None when none does). Nothing past a stop is kept."""
        for token, logprob in zip(tokens, logprobs):
            self._append(req, token, logprob, None, version)
            reason = self.stops.check(req)
            if reason is not None:
                req.num_computed = min(req.num_computed, len(req.all_ids))
                return reason
        return None

    @staticmethod
    def _append(req: Req, token: int, logprob: float, top, version: int) -> None:
        req.all_ids.append(token)
        req.output_ids.append(token)
        req.logprobs.append(logprob)
        req.versions.append(version)
        if req.top_logprobs is not None:
            req.top_logprobs.append(top[: req.request.top_logprobs_num])
