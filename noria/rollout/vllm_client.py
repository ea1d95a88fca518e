"""``VllmEngineClient``: a vLLM OpenAI server as a rollout engine, with the weight versions Noria keeps.

What this module owns: speaking vLLM's public HTTP API for what rollout needs, and the weight
version of every request to an engine that does not report one per request.

==========================  ================================================================
rollout needs               vLLM (0.32) route
==========================  ================================================================
token-id prompt, sampling   ``POST /v1/completions`` with ``prompt: [ids]``, ``max_tokens``,
(temperature, top-p/k,      ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``,
min-p, seed, stop)          ``stop_token_ids``, ``ignore_eos``
output ids, logprobs        ``return_token_ids: true`` (``choices[0].token_ids``) and
                            ``logprobs: 0`` (``choices[0].logprobs.token_logprobs``: the sampled
                            tokens' own; after the temperature with ``--logprobs-mode
                            processed_logprobs``, which the run starts vLLM with)
abort                       cancelling the request closes its connection; vLLM aborts it
pause / resume              ``POST /pause?mode=wait`` / ``POST /resume`` (dev mode)
current version             ``GET /weight_info`` (dev mode; set by the weight sync's
                            ``/update_weight_version``, see ``noria.sync.vllm``)
==========================  ================================================================

Versions: ``/v1/completions`` does not say which weights served a request, so this client tags
each request with the version current when it was admitted, and admits no request across an
update: ``pause("drain")`` closes admission and waits until every request in flight has
finished (each was served by one version from start to end), the weight sync loads the new
folder, and ``resume()`` reads the engine's new version before admission opens again. Requests
arriving meanwhile wait at the gate. The only pause mode is therefore ``drain``
(``noria.rollout.capabilities``).

Not supported (refused at connect or per request): routed experts, top-k logprobs, prefill
scoring (``logprob_start_len``), memory release (vLLM runs disaggregated only). Not guaranteed:
that nothing else sends work to the server or changes its weights (its dev routes are not behind
``--api-key``; it listens on 127.0.0.1 only).
"""

from __future__ import annotations

import asyncio
from typing import Any

from noria.engine.protocol import GenerateOutput, GenerateRequest
from noria.rollout.capabilities import parse_version
from noria.rollout.client import EngineFailure, HttpEngineClient


class VllmEngineClient(HttpEngineClient):
    """A vLLM OpenAI server (started by the run or at ``rollout.engine_url``)."""

    tags_versions = True
    """It keeps the weight version itself: the job pauses and resumes it around every update."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0, process: Any = None,
                 version: int = 0) -> None:  # fmt: skip
        super().__init__(base_url, api_key=api_key, timeout_s=timeout_s, process=process)
        self.name = f"vLLM engine at {self.base_url}"
        self.api_key = api_key
        """The bearer key of its ``/v1`` routes (the run's own, when it started the server)."""
        self.version = version
        """The version every request admitted now is tagged with (changed by ``resume`` only)."""
        self._open = asyncio.Event()
        self._open.set()
        self._in_flight = 0
        self._drained = asyncio.Event()
        self._drained.set()

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        unsupported = [name for name, asked in (("top logprobs", req.top_logprobs_num), ("prefill scoring", req.scores_input),
                                                ("routed experts", req.return_routed_experts)) if asked]  # fmt: skip
        if unsupported:
            raise EngineFailure(f"{self.name}: Noria's vLLM client does not support {', '.join(unsupported)}")
        while not self._open.is_set():  # a weight update is under way: admitted after it, under the new version
            await self._open.wait()
        version = self.version  # no await between the gate and the count: a drain sees this request
        self._in_flight += 1
        self._drained.clear()
        try:
            data = await self._call(self.http.completions(completion_body(req), routing_key=req.routing_key))
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._drained.set()
        return output_from_vllm(data, req, version, self.name)

    async def pause(self, mode: str = "drain") -> None:
        """Close admission, wait for every request in flight to finish, then pause the engine."""
        if mode != "drain":
            raise EngineFailure(f"{self.name}: pause mode {mode!r} is not supported (vLLM: drain only)")
        self._open.clear()
        await self._drained.wait()
        await self._post_query("/pause", {"mode": "wait"})

    async def resume(self) -> None:
        """Learn the version the engine serves now, resume it, and open admission."""
        self.version = await self.weight_version()
        await self._post_query("/resume", {})
        self._open.set()

    async def release_memory(self, weights: bool = False) -> None:
        return None  # disaggregated only: nothing shares its memory

    async def resume_memory(self) -> None:
        return None

    async def weight_version(self) -> int:
        response = await self._call(self.http.http.get("/weight_info"))
        if response.is_error:
            raise EngineFailure(f"{self.name}/weight_info answered {response.status_code}: {response.text[:300]}")
        return parse_version(response.json().get("weight_version"), self.name)

    async def _post_query(self, path: str, params: dict[str, str]) -> None:
        response = await self._call(self.http.http.post(path, params=params))
        if response.is_error:
            raise EngineFailure(f"{self.name}{path} answered {response.status_code}: {response.text[:500]}")


def completion_body(req: GenerateRequest) -> dict[str, Any]:
    """vLLM's ``/v1/completions`` body for ``req`` (defaults left out)."""
    s = req.sampling
    body: dict[str, Any] = {
        "prompt": list(req.input_ids), "max_tokens": s.max_new_tokens, "temperature": s.temperature,
        "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,  # always: else vLLM may fill in generation_config.json's
        "logprobs": 0, "return_token_ids": True, "skip_special_tokens": True,
    }  # fmt: skip
    if s.ignore_eos:
        body["ignore_eos"] = True
    if s.seed is not None:
        body["seed"] = s.seed
    if s.stop:
        body["stop"] = list(s.stop)
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    if req.rid:
        body["request_id"] = req.rid
    return body


def output_from_vllm(data: dict[str, Any], req: GenerateRequest, version: int, name: str) -> GenerateOutput:
    """A ``/v1/completions`` response -> ``GenerateOutput``, every token tagged with ``version``."""
    choices = data.get("choices") or []
    if len(choices) != 1:
        raise EngineFailure(f"{name} answered {len(choices)} choices for one prompt")
    choice = choices[0]
    ids = choice.get("token_ids")
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if ids is None or logprobs is None or len(ids) != len(logprobs) or any(x is None for x in logprobs):
        raise EngineFailure(
            f"{name} answered {'no' if ids is None else len(ids)} token ids and "
            f"{'no' if logprobs is None else len(logprobs)} logprobs (were return_token_ids and logprobs honoured?)"
        )
    usage = data.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return GenerateOutput(
        rid=str(data.get("id", req.rid)), output_ids=[int(t) for t in ids], logprobs=[float(x) for x in logprobs],
        weight_versions=[version] * len(ids), text=choice.get("text", ""), finish_reason=finish_reason(choice),
        prompt_tokens=int(usage.get("prompt_tokens", len(req.input_ids))), cached_tokens=int(cached),
    )  # fmt: skip


def finish_reason(choice: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``finish_reason`` / ``stop_reason`` as Noria's (``GenerateOutput.finish_reason``)."""
    kind = choice.get("finish_reason")
    if kind == "stop":
        return {"type": "stop", "matched": choice.get("stop_reason")}
    if kind == "length":
        return {"type": "length"}
    return {"type": "abort", "message": f"vLLM finish_reason {kind!r}"}
