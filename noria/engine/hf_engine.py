"""The generic engine: any transformers causal LM (``model.impl: hf``, or an architecture with no native
model), served in process with the calls RL needs. Slower than :class:`noria.engine.Engine`, and exact in nothing.

Why it exists: the built-in engine runs Noria's native decoders (Llama, Qwen2, Qwen3, Qwen3-MoE)
through its paged KV cache; a day-0 architecture (GPT-NeoX, GPT-2, ...) has no native model, yet
RL needs an engine that samples with per-request settings, reports the logprob of every sampled
token and takes weight updates. This one wraps the trainer's own wrapper (``noria.models.hf.HFCausalLM``,
so parameter names are transformers' and weight sync works unchanged) and decodes with transformers'
own KV cache (``cache``, ``past_key_values`` before transformers 5.2x), one request at a time, on one worker thread.

What it provides (the subset of ``Engine`` that rollout, evaluation and in-process weight sync call):
``generate`` (async), ``abort``, ``pause`` / ``resume``, ``weight_version``, ``weights`` (the same
``noria.engine.weight_updates.WeightUpdates``: staged updates, commit between two requests'
steps, checksums), ``metrics`` and ``shutdown``. Sampling follows ``SamplingParams``: temperature
(0 = greedy), top-p, top-k, min-p, a per-request seed, EOS and stop token ids, stop strings,
``max_new_tokens``; ``logprobs`` are log_softmax(logits / T) of each sampled token before
truncation, as the built-in engine reports them.

Not guaranteed: speed (no batching across requests, no prefix cache, no CUDA graphs); bitwise
agreement with the trainer's logprobs (transformers' kernels, not Noria's fixed-order ones: the
rollout-vs-trainer difference is reported, not zero); prefill scoring (``logprob_start_len``),
top-k logprobs, routed experts and streaming are refused; HTTP serving (``noria serve``) still
needs a native architecture.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from noria import hardware
from noria.config import EngineConfig
from noria.engine.protocol import GenerateOutput, GenerateRequest, RequestError
from noria.engine.weight_updates import WeightUpdates


@dataclass
class _Job:
    request: GenerateRequest
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    aborted: threading.Event = field(default_factory=threading.Event)


class HFEngine:
    """A transformers model behind the in-process engine calls; see the module docstring."""

    def __init__(self, model: Any, tokenizer: Any, eos_token_ids: set[int], seed: int = 0, max_context: int | None = None) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        # the config's attribute, not its dict: GPT-2 stores it as n_positions behind an attribute map
        self.max_context = max_context or int(getattr(model.hf.config, "max_position_embeddings", None) or 2048)
        self._seed = seed
        # transformers renamed `past_key_values` to `cache` (5.2x); both exist in the versions Noria meets
        self._cache_arg = "cache" if "cache" in inspect.signature(model.hf.forward).parameters else "past_key_values"
        self._step_lock = threading.Lock()  # held for one decode step; weight commits wait for it
        self._open = threading.Event()
        self._open.set()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._live: dict[str, _Job] = {}
        self._served = 0
        self.weights = WeightUpdates(model, self.device, self._between_steps, lambda: None, lambda: None)
        self._thread = threading.Thread(target=self._work, name="noria-hf-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_path(cls, path: str | Path, config: EngineConfig, dtype: str = "auto", device: str = "cpu", seed: int = 0) -> HFEngine:
        """Load a catalog name or HF folder through transformers (``noria.models.load_model(impl="hf")``)."""
        from noria.models import generation_eos, load_model, try_tokenizer
        from noria.models.catalog import model_path

        if config.quantization != "none":
            raise ValueError(
                f"engine.quantization={config.quantization}: {path} is served by the generic transformers engine "
                "(no native model for its architecture, or model.impl=hf), which supports engine.quantization: none only"
            )
        dtype = hardware.resolve_dtype(dtype, device)
        model = load_model(path, dtype=getattr(torch, dtype), device=device, impl="hf")
        tokenizer = try_tokenizer(path)
        eos = set(generation_eos(model_path(path)))
        eos_id = getattr(model.hf.config, "eos_token_id", None)
        eos |= set(eos_id if isinstance(eos_id, list) else [eos_id] if eos_id is not None else [])
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        return cls(model, tokenizer, eos, seed=seed, max_context=config.max_context)

    # ------------------------------------------------------------------------------ the engine calls

    @property
    def weight_version(self) -> int:
        return self.weights.version

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        """Generate to completion on the worker thread; cancelling the await aborts the request."""
        _check_supported(req)
        loop = asyncio.get_running_loop()
        job = _Job(req, loop, loop.create_future())
        if req.rid in self._live:
            raise RequestError(f"rid {req.rid!r} is already in flight")
        if req.rid:
            self._live[req.rid] = job
        self._jobs.put(job)
        try:
            return await job.future
        except asyncio.CancelledError:
            job.aborted.set()
            raise
        finally:
            self._live.pop(req.rid, None)

    def abort(self, rid: str, message: str = "aborted by request") -> None:
        job = self._live.get(rid)
        if job is not None:
            job.aborted.set()

    async def pause(self, mode: str = "retract") -> None:
        """No new request starts until ``resume``; the one decoding finishes its current step."""
        self._open.clear()
        await asyncio.to_thread(self._step_lock.acquire)
        self._step_lock.release()

    async def resume(self) -> None:
        self._open.set()

    def metrics(self) -> dict[str, Any]:
        return {"prefix_hit_rate": 0.0, "retractions": 0, "served": self._served, "weight_version": self.weight_version}

    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        for job in list(self._live.values()):
            job.aborted.set()
        self._open.set()
        self._jobs.put(None)
        self._thread.join(timeout=max(drain_timeout_s, 1.0))

    # ------------------------------------------------------------------------------ the worker

    def _between_steps(self, fn: Callable[[], Any]) -> Any:
        with self._step_lock:
            return fn()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._open.wait()
            try:
                out = self._decode(job)
                _deliver(job, out, None)
            except Exception as e:  # the request fails; the engine keeps serving
                _deliver(job, None, e)
            self._served += 1

    @torch.inference_mode()
    def _decode(self, job: _Job) -> GenerateOutput:
        req, params = job.request, job.request.sampling
        generator = torch.Generator(self.device).manual_seed(params.seed if params.seed is not None else self._seed + self._served)
        ids = torch.tensor([req.input_ids], device=self.device)
        budget = min(params.max_new_tokens, self.max_context - len(req.input_ids))
        out_ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        past, reason = None, {"type": "length", "length": params.max_new_tokens}
        while len(out_ids) < budget:
            if job.aborted.is_set():
                reason = {"type": "abort", "message": "aborted by request"}
                break
            with self._step_lock:
                result = self.model.hf(input_ids=ids, use_cache=True, **{self._cache_arg: past})
                past, logits = result[self._cache_arg], result.logits[0, -1].float()
                token, logprob = _sample(logits, params, generator)
                version = self.weights.version
            out_ids.append(token)
            logprobs.append(logprob)
            versions.append(version)
            ids = torch.tensor([[token]], device=self.device)
            stop = self._stop_reason(token, out_ids, params)
            if stop is not None:
                reason = stop
                break
        text = self.tokenizer.decode(out_ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        return GenerateOutput(
            rid=req.rid, output_ids=out_ids, logprobs=logprobs, weight_versions=versions, text=text,
            finish_reason=reason, prompt_tokens=len(req.input_ids), input_ids=list(req.input_ids),
        )  # fmt: skip

    def _stop_reason(self, token: int, out_ids: list[int], params: Any) -> dict[str, Any] | None:
        if not params.ignore_eos and (token in self.eos or token in params.stop_token_ids):
            return {"type": "stop", "matched": token}
        if params.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(out_ids)
            for stop in params.stop:
                if stop in text:
                    return {"type": "stop", "matched": stop}
        return None


def _sample(logits: torch.Tensor, params: Any, generator: torch.Generator) -> tuple[int, float]:
    """(token, its logprob under log_softmax(logits / T)); greedy at T = 0 (logprob under T = 1)."""
    if params.temperature == 0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, -1)[token])
    logp = torch.log_softmax(logits / params.temperature, -1)
    probs = logp.exp()
    keep = torch.ones_like(probs, dtype=torch.bool)
    if params.top_k > 0:
        keep &= probs >= torch.topk(probs, min(params.top_k, probs.numel())).values[-1]
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs.max()
    if params.top_p < 1:
        order = torch.argsort(probs, descending=True)
        before = torch.cumsum(probs[order], 0) - probs[order]  # mass of the tokens ranked above
        keep[order[before >= params.top_p]] = False
    masked = torch.where(keep, probs, torch.zeros_like(probs))
    token = int(torch.multinomial(masked / masked.sum(), 1, generator=generator))
    return token, float(logp[token])


def _check_supported(req: GenerateRequest) -> None:
    if req.scores_input or req.top_logprobs_num or req.return_routed_experts:
        raise RequestError(
            "the generic transformers engine (model.impl: hf) returns sampled-token logprobs only: no prefill scoring "
            "(logprob_start_len), top-k logprobs or routed experts"
        )


def _deliver(job: _Job, out: GenerateOutput | None, error: BaseException | None) -> None:
    """Hand the result to the caller's event loop; a loop already closed means the caller is gone."""
    try:
        job.loop.call_soon_threadsafe(_settle, job.future, out, error)
    except RuntimeError:  # "Event loop is closed": nobody waits for this answer any more
        pass


def _settle(future: asyncio.Future, out: GenerateOutput | None, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(out)
