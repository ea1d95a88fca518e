"""The engine's request and response records: what clients (in process or over HTTP) exchange.

These mirror SGLang's native ``/generate`` API so that the HTTP server is a thin translation and a
real SGLang server can stand in for the built-in engine: ``SamplingParams`` uses SGLang's field
names, and ``GenerateOutput.meta_info()`` produces SGLang's ``meta_info`` dict (``finish_reason``,
``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``output_token_logprobs``,
``input_token_logprobs`` / ``input_top_logprobs`` (prefill scoring, ``logprob_start_len``),
``weight_version``, ``routed_experts``).

Validation lives here (``SamplingParams.validate``), so every entry point rejects the same bad
input with the same message before a request reaches the scheduler.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field, fields
from typing import Any

from noria.errors import NoriaError


class RequestError(NoriaError):
    """A request is malformed or out of range (HTTP 400); the message says which field."""


@dataclass
class SamplingParams:
    """Per-request sampling settings (SGLang's names and defaults)."""

    max_new_tokens: int = 128
    """Tokens to generate at most; the request finishes with reason ``length`` there."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus: sample from the smallest set of tokens whose probability reaches top_p."""
    top_k: int = -1
    """Sample from the k most likely tokens; -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: generation ends once the decoded output contains one (kept in output_ids)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end generation, besides the model's EOS ids."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks, fixed-length rollouts)."""
    seed: int | None = None
    """Per-request seed: the same request with the same seed gives the same tokens."""

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SamplingParams:
        """Build from a JSON dict; unknown keys are errors (a misspelled key is never ignored)."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RequestError(f"sampling_params: unknown field(s) {unknown}; known: {sorted(known)}")
        if isinstance(data.get("stop"), str):
            data["stop"] = [data["stop"]]
        params = cls(**data)
        params.validate()
        return params

    def validate(self) -> None:
        """Raise ``RequestError`` naming the first field that is out of range or of the wrong type."""
        _check_type("max_new_tokens", self.max_new_tokens, int)
        _check_type("top_k", self.top_k, int)
        for name in ("temperature", "top_p", "min_p"):
            _check_type(name, getattr(self, name), (int, float))
        if self.max_new_tokens < 0:
            raise RequestError(f"sampling_params.max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"sampling_params.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"sampling_params.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1 or self.top_k >= 2**31:  # past 2^31 it overflowed in the engine loop and killed it
            raise RequestError(f"sampling_params.top_k must be -1 or in [1, 2^31), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise RequestError(f"sampling_params.min_p must be in [0, 1), got {self.min_p}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError("sampling_params.stop must be a string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) and 0 <= t < 2**31 for t in self.stop_token_ids):
            raise RequestError("sampling_params.stop_token_ids must be a list of integers in [0, 2^31)")
        if self.seed is not None and not (_is_int(self.seed) and -(2**63) <= self.seed < 2**64):
            raise RequestError(f"sampling_params.seed must be an integer in [-2^63, 2^64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class GenerateRequest:
    """One generation request: prompt token ids plus sampling settings."""

    input_ids: list[int]
    """Prompt token ids, shape [P], P >= 1."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str = ""
    """Request id (unique among in-flight requests); the engine assigns one when empty."""
    return_logprob: bool = True
    """Return the log-probability of every sampled token (the engine computes it either way)."""
    top_logprobs_num: int = 0
    """Also return the k most likely tokens and their log-probabilities at every step."""
    routing_key: str | None = None
    """Session routing key (for routers); the engine itself ignores it."""
    return_routed_experts: bool = False
    """MoE models: also return, per output token, the experts each MoE layer routed it through
    (``GenerateOutput.routed_experts``; rollout routing replay)."""
    logprob_start_len: int = -1
    """Prefill scoring (SGLang's field): with ``return_logprob``, also return the log-probability of
    every input token from this position on (``GenerateOutput.input_logprobs``; the token at
    position 0 has none), and its top ``top_logprobs_num``; -1 returns none. Those positions are
    computed, never taken from the prefix cache. ``max_new_tokens`` 0 scores without generating."""
    images: list[Any] = field(default_factory=list)
    """Vision-language models: the prompt's images in order (``noria.engine.vision.ImageInput``:
    pixel values and the span of placeholder tokens in ``input_ids`` each one fills)."""
    priority: int = 0
    """Admission order (SGLang's field): a waiting request of higher priority is admitted before any of
    lower priority, FIFO among equals; rollout's are 0, a judge sharing the engine sends less."""
    adapter: str | None = None
    """The LoRA adapter this request is served with (a name given to ``Engine.load_adapter``;
    SGLang's ``lora_path``, vLLM's model name), or None for the base model. Unknown names are a
    ``RequestError``."""
    image_data: list[str] = field(default_factory=list)
    """A client's images of the prompt, in order (SGLang's ``image_data``: base64 or data URLs), sent
    as they are over HTTP; an in-process engine gets them processed into ``images`` by its client."""

    @property
    def scores_input(self) -> bool:
        """Whether the request asks for input-token logprobs."""
        return self.return_logprob and self.logprob_start_len >= 0


@dataclass
class GenerateOutput:
    """The result (or a streamed partial result) of a request."""

    rid: str
    output_ids: list[int]
    """Generated token ids (stop token included when the request stopped on one)."""
    logprobs: list[float]
    """Log-probability of each output token (natural log) under the model's distribution at the
    request's temperature, log_softmax(logits / T), before top-p/top-k/min-p truncation; at T = 0
    (greedy) under log_softmax(logits). This is what a trainer recomputes with the same T."""
    weight_versions: list[int]
    """Weight version that produced each output token."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per output token: the top-k (token id, logprob) pairs, when requested."""
    text: str = ""
    """Decoded output (empty when the engine has no tokenizer)."""
    finish_reason: dict[str, Any] | None = None
    """None while running; else {"type": "stop"|"length"|"abort", "matched": token id or stop string, "message": ...}."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    input_ids: list[int] = field(default_factory=list)
    """The prompt's ids, when ``input_logprobs`` are returned (they name the scored tokens)."""
    """Prompt tokens served from the prefix cache (not recomputed)."""
    input_logprobs: list[float | None] | None = None
    """With ``logprob_start_len`` >= 0: the logprob of each input token from that position on, under
    the same distribution as ``logprobs`` (the request's temperature); None at position 0."""
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    """With ``logprob_start_len`` >= 0 and ``top_logprobs_num``: per input token from that position
    on, the top-k (token id, logprob) of the distribution that predicted it (None at position 0)."""
    adapter: str | None = None
    """The request's LoRA adapter (None: the base model)."""
    adapter_version: int | None = None
    """The adapter's version (``Engine.update_adapter``) when this output was made."""
    routed_experts: Any = None
    """With ``return_routed_experts``: integer tensor [R, L, k] (R output tokens, L MoE layers, top-k;
    ``noria.models.moe.route_dtype``): row i holds the experts of the forward step that sampled
    output token i, i.e. the routing of the position before it, recorded when it was sampled (so
    a retraction's re-prefill or a later weight update never rewrites it). None otherwise."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def weight_version(self) -> int | None:
        """The newest weight version that produced a token of this output."""
        return max(self.weight_versions) if self.weight_versions else None

    def meta_info(self) -> dict[str, Any]:
        """SGLang's ``meta_info`` dict for this output."""
        info: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "weight_version": self.weight_version,
            "weight_versions": self.weight_versions,
            # SGLang's shape: [logprob, token_id, token_text-or-None] per token.
            "output_token_logprobs": [[lp, tid, None] for lp, tid in zip(self.logprobs, self.output_ids)],
        }
        if self.adapter is not None:
            info["adapter"] = self.adapter
            info["adapter_version"] = self.adapter_version
        if self.input_logprobs is not None:
            start = self.prompt_tokens - len(self.input_logprobs)
            info["input_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(self.input_logprobs, self.input_ids[start:])]
            if self.input_top_logprobs is not None:
                info["input_top_logprobs"] = [
                    None if step is None else [[lp, tid, None] for tid, lp in step] for step in self.input_top_logprobs
                ]
        if self.top_logprobs is not None:
            info["output_top_logprobs"] = [[[lp, tid, None] for tid, lp in step] for step in self.top_logprobs]
        if self.routed_experts is not None:
            info.update(encode_routes(self.routed_experts))
        return info


def encode_routes(routes: Any) -> dict[str, Any]:
    """SGLang's ``meta_info["routed_experts"]`` (base64 of int32 ids, row-major) for routes
    [R, L, k], and their shape (``routed_experts_shape``, which SGLang does not send: its rows are
    every position but the last, prompt included, where Noria's are the output tokens)."""
    import numpy as np

    array = np.ascontiguousarray(routes.numpy().astype(np.int32))
    return {"routed_experts": base64.b64encode(array.tobytes()).decode("ascii"), "routed_experts_shape": list(array.shape)}


def decode_routes(info: dict[str, Any], completion_tokens: int) -> Any:
    """The routes of ``meta_info`` as an int32 tensor: [R, L, k] from Noria (``routed_experts_shape``),
    [R, L * k] from SGLang (its last R rows: the positions that sampled the output); None if absent."""
    import numpy as np
    import torch

    data = info.get("routed_experts")
    if data is None:
        return None
    flat = torch.from_numpy(np.frombuffer(base64.b64decode(data), dtype=np.int32).copy())
    shape = info.get("routed_experts_shape")
    if shape is not None:
        return flat.view(*shape)
    rows = int(info.get("prompt_tokens", 0)) + completion_tokens - 1
    if rows <= 0 or flat.numel() % rows:
        raise RequestError(f"routed_experts holds {flat.numel()} ids, not a whole number of {rows} positions")
    return flat.view(rows, -1)[rows - completion_tokens :]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_type(name: str, value: Any, types: type | tuple[type, ...]) -> None:
    if isinstance(value, bool) or not isinstance(value, types):
        raise RequestError(f"sampling_params.{name} has the wrong type: {value!r}")
