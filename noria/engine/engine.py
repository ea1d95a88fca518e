"""The built-in rollout engine: a step loop on a background thread, and the API callers use.

Threads and data flow::

    callers (asyncio or threads)            engine thread (the only one touching engine state)
    submit / abort / pause / update  ──▶ inbox ──▶ drain commands between steps
                                                   schedule ─▶ launch (forward + sample) ─▶ process
    callback(GenerateOutput)  ◀──────────────────── finished (or streamed) requests

Overlap (``engine.overlap``; auto: with CUDA graphs). A decode step sampled in its CUDA graph is
only queued on the device. Before waiting for its tokens, the loop launches the next decode step
(``Scheduler.follow``: the same running requests, less those the step's token ends by length;
their input ids are the step's samples, copied on the device), then processes the first step while
the GPU runs the second. A request that a stop token ends has one extra step computed and dropped.
Nothing is launched ahead while a command waits, a request waits for admission or the scheduler is
paused: commands always run with no step in flight.

The thread, its inbox and the request plumbing (``generate``, ``generate_batch``) are
``noria.engine.thread``'s, shared with the diffusion engine. Every mutation of scheduler, cache or
weights runs as a command on the engine thread between two steps, so a weight update never lands
mid-forward and every sampled token carries the version of the weights that produced it.

What blocks on what:

- ``await generate`` / ``stream``: until the request finishes (each streamed part after a step).
- ``await pause`` / ``resume``, ``flush_cache``, ``release_memory_occupation`` /
  ``resume_memory_occupation``: until the current step ends and the command has run.
- weight updates go through the engine's component ``engine.weights``
  (``noria.engine.weight_updates.WeightUpdates``; synchronous methods, call them via
  ``asyncio.to_thread`` from async code): they are staged first: bytes are validated and copied
  into staging buffers on the caller's thread while generation continues (a distributed update
  receives there too); the commit then swaps the buffers into the parameters between two steps (no
  copy) and repacks the fast path's weights. A failed update, at any point before the commit,
  changes nothing. ``engine.weight_version`` is the component's version.
- ``submit`` / ``submit_many`` / ``abort``: never (they post a command; ``generate_batch`` posts one).

MoE routes (``GenerateRequest.return_routed_experts``): a step with such a request also returns
the routers' top-k at each sampling position (``ModelRunner.forward_routed``, or the graph's
routes output), and ``Scheduler.process`` appends each to its token as it is sampled, so a
token's route is the one its own forward used: never recomputed by a re-prefill after a
retraction, and from the weight version the token carries.

Callbacks run on the engine thread and must not block (``generate`` and ``stream`` hand results to
the caller's event loop with ``call_soon_threadsafe``). Not guaranteed: order among requests that
arrive in the same step; unseeded sampling is reproducible only for the same arrival order;
deterministic mode holds on CPU (bf16 and fp32, every ISA: tests/engine/test_exact_agreement.py)
and on CUDA with Triton (``noria.models.exact_cuda``), and not across a retraction.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from noria import hardware
from noria.config import EngineConfig, ensure_valid
from noria.engine import scoring, vision
from noria.engine.kv_cache import KVCache, zeroed_pools
from noria.engine.lora import LoraRegistry
from noria.engine.lora_engine import AdapterMethods
from noria.engine.protocol import GenerateOutput, GenerateRequest, RequestError
from noria.engine.radix import RadixCache
from noria.engine.runner import ModelRunner
from noria.engine.sampling import device_sampleable, draw_uniforms, sample
from noria.engine.scheduler import Chunk, Req, Scheduler, StopChecker
from noria.engine.speculative import Speculator
from noria.engine.thread import EngineThread, call_in_loop, check_pause_mode, generate, generate_batch
from noria.engine.weight_updates import WeightUpdates
from noria.engine.weights import WeightUpdateError
from noria.models import DecoderLM, generation_eos, load_model, model_path, try_tokenizer
from noria.process.usage import release_free_memory

log = logging.getLogger(__name__)

_THROUGHPUT_WINDOW_S = 10.0


class Engine(AdapterMethods):
    """Continuous-batching generation over a paged KV cache; see the module docstring. LoRA
    adapters: ``load_adapter`` and the rest of ``noria.engine.lora_engine``."""

    def __init__(
        self,
        model: DecoderLM,
        tokenizer: Any | None,
        config: EngineConfig,
        weight_version: int = 0,
        eos_token_ids: Iterable[int] | None = None,
        seed: int = 0,
    ) -> None:
        if not isinstance(model, DecoderLM):
            raise TypeError(f"the engine runs the native DecoderLM (llama/qwen2/qwen3/qwen3_moe), got {type(model).__name__}")
        ensure_valid(config)  # once: a loaded config was validated when loaded
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        self.max_context = config.max_context or model.args.max_position_embeddings
        self.kv = KVCache.for_model(model.args, config, self.dtype, self.device)
        self.radix = RadixCache(self.kv.allocator, config.block_size, enabled=config.prefix_cache)
        eos = set(model.args.eos_token_ids) if eos_token_ids is None else set(eos_token_ids)
        if eos_token_ids is None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.scheduler = Scheduler(config, self.kv, self.radix, StopChecker(eos, tokenizer))
        self.runner = ModelRunner(
            model, self.kv, self.device, config.attention, config.deterministic, max_batch=config.max_running_requests,
            max_positions=self.max_context, quantization=config.quantization,
        )
        self.lora = self.runner.lora = LoraRegistry(model, config.lora_max_adapters, config.deterministic, config.lora_max_memory_mb)
        """The served LoRA adapters (``noria.engine.lora``)."""
        self._generator = torch.Generator(self.device).manual_seed(seed)
        spec = config.speculative
        self.speculator = None if spec.method == "none" else Speculator(
            spec, self.scheduler, config.max_batch_tokens, self.runner, tokenizer, lambda: self.weights.version)
        """Speculative decoding (``noria.engine.speculative``), or None."""
        self._thread = EngineThread(self._loop, "noria-engine", cpu=self.device.type == "cpu")
        self._live: set[str] = set()
        self._live_lock = threading.Lock()
        self.weights = WeightUpdates(
            self.model, self.device, self._thread.call, self.runner.refresh_weights, self._after_commit, weight_version
        )
        """Staging, commit, version and checksums of the served weights (``noria.engine.weight_updates``)."""
        self._kv_shape: tuple[int, ...] | None = None  # set while the KV cache is released
        self._packs_dropped = False  # the fast decoder's packed weights were dropped by the release
        self._paused_before_release = False
        self._stats = _Stats()
        graphs = self.runner.graphs
        self._overlap = config.overlap == "on" or (
            config.overlap == "auto" and graphs is not None and graphs.device_sampling
        )
        """Launch each decode step before the previous one's tokens are on the host (``_follow``)."""
        self._thread.start()

    @classmethod
    def from_path(
        cls, path: str | Path, config: EngineConfig, dtype: str = "auto", device: str = "cpu", **kwargs: Any
    ) -> Engine:
        """Load a native checkpoint (catalog name or HF folder) with its tokenizer and EOS ids;
        ``dtype`` ``auto`` is this machine's (``noria.hardware.auto_dtype``)."""
        dtype = hardware.resolve_dtype(dtype, device)
        model = load_model(path, dtype=getattr(torch, dtype), device=device, impl="native")
        folder = model_path(path)
        tokenizer = try_tokenizer(path)
        eos = set(model.args.eos_token_ids) | generation_eos(folder)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        kwargs.setdefault("eos_token_ids", eos)
        return cls(model, tokenizer, config, **kwargs)

    # ------------------------------------------------------------------------------ requests

    def submit(self, req: GenerateRequest, callback: Callable[[GenerateOutput], None], stream: bool = False) -> str:
        """Queue a request; ``callback`` gets the final output (and, with ``stream``, one partial
        output after every step that adds a token). Returns the request id. Raises RequestError."""
        return self.submit_many([req], [callback], stream)[0]

    def submit_many(self, requests: list[GenerateRequest], callbacks: list[Callable], stream: bool = False) -> list[str]:
        """``submit`` of several requests in one command, all or none: all are queued before the next step
        (one by one, a step may start with the first few, and speculation would see a smaller batch)."""
        self._thread.check_accepting()
        internals = [self._internal(self._validated(r), cb, stream) for r, cb in zip(requests, callbacks, strict=True)]
        rids = [i.request.rid for i in internals]
        with self._live_lock:
            taken = [r for r in rids if r in self._live] + [r for r, n in collections.Counter(rids).items() if n > 1]
            if taken:
                raise RequestError(f"rid {taken[0]!r} is already in flight")
            self._live.update(rids)
        self._thread.post(lambda: [self._enqueue(i) for i in internals])
        self._thread.give_back_workers()  # after posting them: the engine starts on them meanwhile
        return rids

    def _internal(self, req: GenerateRequest, callback: Callable, stream: bool) -> Req:
        internal = Req(request=req, callback=callback, stream=stream, max_total_tokens=self._max_total(req))
        if req.sampling.seed is not None:
            internal.generator = torch.Generator(self.device).manual_seed(req.sampling.seed)
        return internal

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        """Generate to completion; cancelling the await aborts the request."""
        return await generate(self.submit, self.abort, req)

    async def stream(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Cumulative partial outputs after every step; the last one is finished. Leaving early aborts."""
        loop = asyncio.get_running_loop()
        parts: asyncio.Queue[GenerateOutput] = asyncio.Queue()
        rid = self.submit(req, lambda out: call_in_loop(loop, parts.put_nowait, out), stream=True)
        finished = False
        try:
            while not finished:
                out = await parts.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(rid)

    def generate_batch(self, requests: list[GenerateRequest], timeout_s: float | None = None) -> list[GenerateOutput]:
        """Blocking convenience for scripts and benchmarks: submit all, wait for all, in order."""
        return generate_batch(self.submit_many, requests, timeout_s, many=True)

    def abort(self, rid: str, message: str = "aborted by request") -> None:
        """Abort a waiting or running request (its callback gets reason abort); unknown rids are ignored."""
        self._thread.post(lambda: self._notify([r for r in [self.scheduler.abort(rid, message)] if r]))

    def abort_all(self, message: str = "aborted by request") -> None:
        self._thread.post(lambda: self._notify(self.scheduler.abort_all(message)))

    # ------------------------------------------------------------------------------ control

    async def pause(self, mode: str = "retract") -> None:
        """Stop generating after the current step. ``retract`` frees all KV (requests resume from
        their output so far); ``in_place`` keeps it. Queued and new requests wait until resume."""
        check_pause_mode(mode)
        await asyncio.wrap_future(self._thread.post_future(lambda: self.scheduler.pause(mode)))

    async def resume(self) -> None:
        """Continue generating; refused while the KV cache is released (resume its memory first)."""

        def resume() -> None:
            if self._kv_shape is not None:
                raise RequestError("the KV cache is released: call resume_memory_occupation first")
            self.scheduler.resume()

        await asyncio.wrap_future(self._thread.post_future(resume))

    def flush_cache(self) -> int:
        """Drop the prefix cache (blocks in use stay with their requests); returns blocks dropped."""
        return self._thread.call(self.radix.flush)

    def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, let in-flight ones finish for up to ``drain_timeout_s``, abort the rest."""
        self._thread.shutdown(self._has_requests, lambda: self.abort_all("engine shut down"), drain_timeout_s)

    # ------------------------------------------------------------------------------ weights

    @property
    def weight_version(self) -> int:
        """The version of the weights being served (owned by :attr:`weights`)."""
        return self.weights.version

    # ------------------------------------------------------------------------------ memory

    def release_memory_occupation(self, weights: bool = False) -> None:
        """Free the KV cache (SGLang's name): pause with retraction (running requests go back to the
        queue with their output so far), drop the prefix cache, free the K/V pools and the weight
        staging buffers. Requests wait until :meth:`resume_memory_occupation`. ``weights`` (SGLang's
        ``weights`` tag): free the live weights as well, where a full update can take them back (an
        unquantized CPU engine serving no LoRA adapter; 0.27 GB of SmolLM2-135M in bf16), for a
        colocated trainer whose sync writes every weight before the resume."""

        def release() -> None:
            if self._kv_shape is not None:
                return
            self._paused_before_release = self.scheduler.paused is not None
            self.scheduler.pause("retract")
            self.radix.flush()
            if self.kv.allocator.num_free_blocks != self.kv.num_blocks:
                raise RuntimeError("KV blocks are still held after retracting every request")
            self._kv_shape = tuple(self.kv.k_pools[0].shape)
            empty = torch.empty(0, dtype=self.dtype, device=self.device)
            self.kv.k_pools = [empty] * len(self.kv.k_pools)
            self.kv.v_pools = [empty] * len(self.kv.v_pools)
            self._packs_dropped = self._drop_packed_weights()
            live = weights and self.device.type == "cpu" and not getattr(self.runner, "quantized", False) and not self.lora.adapters
            self.weights.release(live=live)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            else:  # the rollout's freed buffers leave the C heap before the trainer's turn
                release_free_memory()

        self._thread.call(release)

    def resume_memory_occupation(self) -> None:
        """Allocate the KV cache again and resume generation (unless it was paused before release)."""

        def resume() -> None:
            if self._kv_shape is None:
                return
            if self.weights.released:
                raise WeightUpdateError("resume_memory_occupation: the weights were released and no full update has come since")
            self.kv.k_pools, self.kv.v_pools = zeroed_pools(len(self.kv.k_pools), self._kv_shape, self.dtype, self.device)
            self.kv.allocator.reset()  # every block free (released), none written in the new pools
            self._kv_shape = None
            if self._packs_dropped:  # no weight update came meanwhile (it would have re-packed them)
                self.runner.refresh_weights()
                self._packs_dropped = False
            if not self._paused_before_release:
                self.scheduler.resume()

        self._thread.call(resume)

    def save_drafter(self, path: str | Path) -> bool:
        """Write the mlp drafter's state (``noria.engine.drafter``) to ``path`` between two steps;
        False when the engine has none."""
        drafter = self.speculator.drafter if self.speculator is not None else None
        return drafter is not None and self._thread.call(lambda: drafter.save(path)) is not None

    def load_drafter(self, path: str | Path) -> None:
        """Continue from a saved mlp drafter (a resumed run's checkpoint), between two steps."""
        self._thread.call(lambda: self.speculator.drafter.load(path))

    @property
    def memory_released(self) -> bool:
        return self._kv_shape is not None

    def _after_commit(self) -> None:
        """After a weight commit (between steps): the prefix cache holds the old weights' K/V; and
        while the memory is released (a colocated trainer's turn, which syncs before resuming), the
        retired weights are not kept as the next update's staging buffers, since the next release
        would free them unused (0.27 GB of SmolLM2-135M through every rollout and evaluation)."""
        self.radix.flush()
        if self.memory_released:
            self.weights.release()
            self._packs_dropped = False  # the commit's refresh_weights re-packs them

    def _drop_packed_weights(self) -> bool:
        """Drop the CPU fast decoder's packed copies of the weights while the memory is released
        (0.26 GB of SmolLM2-135M in bf16 through a trainer's turn); the model's modules would serve
        until a re-pack. Not integer weights (``engine.quantization`` int8 / int4): the only copy.
        True if dropped."""
        fast = self.runner.fast
        if fast is None or getattr(self.runner, "quantized", False):
            return False
        fast.wait_packed()  # a pack in flight would install them again
        fast.packed = None
        return True

    # ------------------------------------------------------------------------------ observability

    def get_load(self) -> dict[str, Any]:
        """Running and waiting requests and KV usage (a snapshot; read without stopping the loop)."""
        return {
            "num_running_reqs": len(self.scheduler.running),
            "num_waiting_reqs": len(self.scheduler.waiting),
            "kv_usage": self.kv.usage,
        }

    def metrics(self) -> dict[str, Any]:
        """The load, throughput and cache counters, the weight version, and ``packing_weights``: True
        while the CPU fast path re-packs its weights after an update (the model's modules serve).
        ``prefix_hit_rate`` is cumulative since start; ``prefix_prompt_tokens`` and
        ``prefix_cached_tokens`` are its running totals (first admissions), whose differences
        between two reads give the hit rate of the interval (a training step's)."""
        return {
            **self.get_load(),
            "tokens_per_s": self._stats.tokens_per_s(),
            "generated_tokens": self._stats.generated,
            "steps": self._stats.steps,
            "overlapped_steps": self._stats.overlapped,
            "prefix_hit_rate": self.radix.hit_rate,
            "prefix_prompt_tokens": self.radix.prompt_tokens,
            "prefix_cached_tokens": self.radix.hit_tokens,
            "cached_blocks": self.radix.num_cached_blocks,
            "evictions": self.radix.evictions,
            "retractions": self.scheduler.retractions,
            "weight_version": self.weight_version,
            "packing_weights": self.runner.fast is not None and self.runner.fast.packed is None,
            **(self.speculator.metrics() if self.speculator is not None else {}),
        }

    # ------------------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        try:
            if self.device.type == "cuda":  # Triton and graph capture launch on the current device
                torch.cuda.set_device(self.device)
            step: _Step | None = None
            while True:
                if step is None:
                    if self._thread.stopping:
                        break
                    if not self.scheduler.has_work and self.speculator is not None and self.speculator.train_slice():
                        self._thread.drain(block=False)  # the mlp drafter learns one step at a time while idle
                        continue
                    if not self.scheduler.has_work:
                        self._thread.give_back_workers(idle=True)
                    self._thread.drain(block=not self.scheduler.has_work)
                    chunks = [] if self._thread.stopping else self.scheduler.schedule()
                    if not chunks:
                        if self.scheduler.has_work and not self._thread.stopping:
                            self._thread.drain(block=True, timeout=0.005)  # nothing fits now; wait for a command
                        continue
                    step = self._launch(chunks)
                following = self._follow(step)  # queued behind ``step`` before the host waits for it
                self._finish(step)
                step = following
        except BaseException as e:  # the loop is dead: fail every request instead of hanging callers
            self._die(e)

    def _launch(self, chunks: list[Chunk], feed: torch.Tensor | None = None) -> _Step:
        """Start a step: a decode step sampled in its CUDA graph is only queued on the device (its
        tokens come back in :meth:`_finish`); any other step runs and samples here."""
        reqs = [c.req for c in chunks if c.sample]
        routed = any(r.routes is not None for r in reqs)
        if self.speculator is not None and feed is None and self.speculator.propose(chunks, self._generator):  # verify chunks
            return _Step(chunks, done=self.speculator.run(self.runner, chunks, self._generator, self.config.deterministic))
        if self.runner.samples_in_graph(chunks):
            params = [r.request.sampling for r in reqs]
            if device_sampleable(params, max((r.request.top_logprobs_num for r in reqs), default=0)):
                temps = [0.0 if p.greedy else float(p.temperature) for p in params]
                uniforms = draw_uniforms(params, [r.generator for r in reqs], self._generator)
                launched = self.runner.launch_sampled(chunks, temps, uniforms, feed, routes=routed)
                return _Step(chunks, launched=launched)
        if feed is not None:
            raise RuntimeError("a step fed on the device must run from a CUDA graph")
        rows = scoring.score_rows(chunks)
        if rows:  # prefill scoring: the scored rows' logits come with the sampling rows'
            logits, scored = self.runner.forward_scoring(chunks, [r.row for r in rows])
            return _Step(chunks, done=self._sample(logits, reqs), scored=scoring.score(scored, chunks, rows))
        if routed:
            logits, routes = self.runner.forward_routed(chunks)
            return _Step(chunks, done=self._sample(logits, reqs), routes=routes)
        return _Step(chunks, done=self._sample(self.runner.forward(chunks), reqs))

    def _follow(self, step: _Step) -> _Step | None:
        """Overlap (``engine.overlap``): launch the decode step after ``step`` before waiting for
        ``step``'s tokens (``Scheduler.follow`` says which requests continue; their input ids are
        ``step``'s samples, copied on the device). Only when no command waits: commands (new
        requests, aborts, updates, pauses) run between steps with nothing in flight."""
        if not self._overlap or self._thread.stopping or not self._thread.idle:
            return None
        if self.speculator is not None and self.speculator.active(step.chunks):  # the next step may verify drafts
            return None
        follow = self.scheduler.follow(step.chunks)
        if follow is None:
            return None
        rows = [row for row, _ in follow]
        chunks = [c for _, c in follow]
        if step.launched is None:  # the step ran on the host: its tokens are known
            ids = step.result()[0]
            for row, c in follow:
                c.token = ids[row]
            self._stats.overlapped += 1
            return self._launch(chunks)
        feed = step.launched.ids
        if len(rows) != len(step.chunks):
            feed = feed.index_select(0, torch.tensor(rows, device=feed.device))
        self._stats.overlapped += 1
        return self._launch(chunks, feed)

    def _finish(self, step: _Step) -> None:
        ids, logprobs, top = step.result()
        scoring.record(step.scored)
        reqs = {id(c.req): c.req for c in step.chunks}.values()
        before = sum(len(r.output_ids) for r in reqs)  # what is kept counts: not a result dropped, nor a draft past a stop
        notify = self.scheduler.process(step.chunks, ids, logprobs, top, self.weight_version, step.routes())
        self._stats.record(sum(len(r.output_ids) for r in reqs) - before)
        if self.speculator is not None:
            self.speculator.after_step(step.chunks)
        self._notify(notify)

    def _sample(self, logits: torch.Tensor, reqs: list[Req]):
        if not reqs:
            return [], [], None
        k = max(r.request.top_logprobs_num for r in reqs)
        params = [r.request.sampling for r in reqs]
        res = sample(logits, params, [r.generator for r in reqs], self._generator, k, self.config.deterministic)
        top = None
        if res.top_ids is not None:
            top = [list(zip(i, lp)) for i, lp in zip(res.top_ids.tolist(), res.top_logprobs.tolist())]
        return res.token_ids.tolist(), res.logprobs.tolist(), top

    def _enqueue(self, req: Req) -> None:
        gone = self._pin_adapter(req)
        if gone is not None:
            req.finish_reason = {"type": "abort", "message": gone}
            self._notify([req])
        elif req.request.sampling.max_new_tokens == 0 and req.scoring_from is None:
            req.finish_reason = {"type": "length", "length": 0}
            self._notify([req])
        else:
            self.scheduler.add(req)

    def _notify(self, reqs: list[Req]) -> None:
        for req in reqs:
            text = self._decode(req.output_ids)
            if req.finish_reason is not None:
                self._unpin_adapter(req)
                with self._live_lock:
                    self._live.discard(req.rid)
            try:
                req.callback(req.output(text))
            except Exception:  # a broken client callback must not take down other requests
                log.exception("callback of request %s raised; the engine continues", req.rid)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _die(self, error: BaseException) -> None:
        self._thread.fail(error)
        self._notify(self.scheduler.abort_all(f"engine error: {type(error).__name__}: {error}"))

    # ------------------------------------------------------------------------------ helpers

    def _has_requests(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self._live)

    def _validated(self, req: GenerateRequest) -> GenerateRequest:
        req.sampling.validate()
        ids = req.input_ids
        vocab = self.model.args.vocab_size
        if not isinstance(ids, list) or not ids:
            raise RequestError("input_ids must be a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise RequestError(f"input_ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_context:
            raise RequestError(
                f"prompt has {len(ids)} tokens; the context limit is {self.max_context} (prompt + output)"
            )
        if req.return_routed_experts and not self.model.args.moe_layers:
            raise RequestError(f"return_routed_experts: this {self.model.args.model_type} model has no MoE layer")
        if not isinstance(req.top_logprobs_num, int) or not 0 <= req.top_logprobs_num <= vocab:
            raise RequestError(f"top_logprobs_num must be in [0, {vocab}], got {req.top_logprobs_num!r}")
        self._check_scoring(req)
        self._check_adapter(req)
        vision.check_request(self.model, req)
        needed = self._max_total(req)
        if needed > self.kv.capacity_tokens:
            raise RequestError(
                f"request needs up to {needed} tokens of KV cache (prompt {len(ids)} + max_new_tokens "
                f"{req.sampling.max_new_tokens}), more than the whole cache ({self.kv.capacity_tokens})"
            )
        return dataclasses.replace(req, rid=req.rid or uuid.uuid4().hex)

    @staticmethod
    def _check_scoring(req: GenerateRequest) -> None:
        start = req.logprob_start_len
        if not isinstance(start, int) or isinstance(start, bool) or not -1 <= start < len(req.input_ids):
            raise RequestError(f"logprob_start_len must be -1 or in [0, {len(req.input_ids)}) (the prompt's length), got {start!r}")
        if req.scores_input and req.return_routed_experts:
            raise RequestError("logprob_start_len (prefill scoring) cannot be combined with return_routed_experts")

    def _max_total(self, req: GenerateRequest) -> int:
        return min(len(req.input_ids) + req.sampling.max_new_tokens, self.max_context)


class _Stats:
    """Generated tokens per second over a sliding window, and totals."""

    def __init__(self) -> None:
        self.generated = 0
        self.steps = 0
        self.overlapped = 0
        """Steps launched before the previous step's tokens were on the host (``engine.overlap``)."""
        self._window: collections.deque[tuple[float, int]] = collections.deque()

    def record(self, tokens: int) -> None:
        now = time.monotonic()
        self.generated += tokens
        self.steps += 1
        self._window.append((now, tokens))
        while self._window and now - self._window[0][0] > _THROUGHPUT_WINDOW_S:
            self._window.popleft()

    def tokens_per_s(self) -> float:
        window = list(self._window)
        if len(window) < 2:
            return 0.0
        span = window[-1][0] - window[0][0]
        return sum(n for _, n in window[1:]) / span if span > 0 else 0.0


class _Step:
    """A launched step: its chunks and, when sampled on the device and not yet waited for, the
    launch handle; else its host results."""

    def __init__(
        self, chunks: list[Chunk], launched=None, done=None, routes: torch.Tensor | None = None, scored: list | None = None
    ) -> None:
        self.chunks = chunks
        self.scored = scored or []
        """Prefill scoring results of the step (``noria.engine.scoring.score``)."""
        self.launched = launched
        self._done = done
        self._routes = routes

    def routes(self) -> torch.Tensor | None:
        """Host [S, L, k] routes of the sampling chunks when the step captured them; blocks like
        :meth:`result`."""
        if self.launched is not None:
            return self.launched.routes()
        return self._routes

    def result(self) -> tuple[list[int], list[float], list | None]:
        """(ids, logprobs, top logprobs) of the sampling chunks; blocks until the step ends."""
        if self._done is None:
            ids, logprobs = self.launched.result()
            self._done = (ids, logprobs, None)
        return self._done
