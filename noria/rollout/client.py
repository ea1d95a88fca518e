"""Engine clients: how rollout talks to an engine, in process or over HTTP, with the same calls.

What this module owns: ``EngineClient``, the small async surface the rollout and the loop use
(``generate``, ``pause``, ``resume``, ``release_memory``, ``resume_memory``, ``weight_version``),
and its two implementations:

- ``LocalEngineClient(engine)``: the built-in ``Engine`` in this process (colocated placement);
- ``HttpEngineClient(base_url)``: ``noria serve``, an SGLang server, or a router in front of them,
  through SGLang's native HTTP API (``/generate`` with ``input_ids``, ``return_logprob``).

Both return ``GenerateOutput`` records: token ids, the log-probability of every sampled token and
the weight version that produced each token (an SGLang server reports one version per request, a
string such as ``"3"``; it is repeated per token; a missing or non-numeric one is an error, never a
guess), and on request the MoE routes of each output token (``routed_experts``).

Failure: a dead engine (the in-process thread stopped, the server refuses connections or its
process exited) raises ``EngineFailure`` naming the engine; a request running past
``timeout_s`` raises it too, so a rollout never waits forever. Nothing is retried here.
"""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any, Protocol

import httpx

from noria.engine.protocol import GenerateOutput, GenerateRequest, decode_routes
from noria.errors import EngineFailure, NoriaError
from noria.rollout.capabilities import parse_version
from noria.router.client import RoutedClient


class EngineClient(Protocol):
    """What rollout needs from an engine."""

    name: str
    """Human-readable name used in errors (``in-process engine`` or the base URL)."""

    async def generate(self, req: GenerateRequest) -> GenerateOutput: ...

    async def pause(self, mode: str = "retract") -> None: ...

    async def resume(self) -> None: ...

    async def release_memory(self, weights: bool = False) -> None: ...

    async def resume_memory(self) -> None: ...

    async def weight_version(self) -> int: ...

    async def aclose(self) -> None: ...


class LocalEngineClient:
    """The built-in engine running in this process."""

    def __init__(self, engine: Any, timeout_s: float = 600.0, name: str = "in-process engine", folder: Any = None) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.name = name
        self.folder = folder
        """The model folder (its processor turns a request's ``image_data`` into the engine's images)."""
        self._images: Any = None

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        if getattr(req, "image_data", None) and not req.images:  # decoding and processing images: off the event loop
            req = await asyncio.to_thread(self._with_images, req)
        try:
            return await asyncio.wait_for(self.engine.generate(req), self.timeout_s)
        except TimeoutError as e:
            raise EngineFailure(f"{self.name}: no answer within rollout.engine_timeout_s={self.timeout_s:g} s") from e
        except NoriaError:
            raise
        except Exception as e:  # EngineDead and anything else the engine thread raised
            raise EngineFailure(f"{self.name} failed: {type(e).__name__}: {e}") from e

    async def abort(self, rid: str) -> None:
        """Abort request ``rid``: its ``generate`` answers with the tokens so far (reason abort)."""
        self.engine.abort(rid)

    def _with_images(self, req: GenerateRequest) -> GenerateRequest:
        """``req`` with its ``image_data`` processed as ``noria serve`` processes SGLang's."""
        from dataclasses import replace

        from noria.engine.vision import ImagePrompts

        if self._images is None:
            if self.folder is None:
                raise NoriaError(f"{self.name}: a request with images, but the client was given no model folder to process them with")
            self._images = ImagePrompts(self.engine.model, self.folder)
        return replace(req, images=self._images.from_data(list(req.input_ids), req.image_data))

    async def pause(self, mode: str = "retract") -> None:
        await self.engine.pause(mode)

    async def resume(self) -> None:
        await self.engine.resume()

    async def release_memory(self, weights: bool = False) -> None:
        release = getattr(self.engine, "release_memory_occupation", None)
        if release is not None:
            await asyncio.to_thread(release, weights=weights)

    async def resume_memory(self) -> None:
        resume = getattr(self.engine, "resume_memory_occupation", None)
        if resume is not None:
            await asyncio.to_thread(resume)

    async def weight_version(self) -> int:
        return int(self.engine.weight_version)

    async def aclose(self) -> None:
        return None


class HttpEngineClient:
    """An engine server (``noria serve``, SGLang) or a router, over SGLang's native HTTP API."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0, process: Any = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.name = f"engine at {self.base_url}"
        self.timeout_s = timeout_s
        self.process = process
        """The engine's ``subprocess.Popen`` when this run started it; checked when a request fails."""
        self.http = RoutedClient(self.base_url, api_key=api_key, timeout_s=timeout_s)

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        body = {
            "input_ids": req.input_ids,
            "sampling_params": sampling_dict(req),
            "return_logprob": True,
            "rid": req.rid or None,
        }
        if req.rid == "":
            body.pop("rid")
        if req.return_routed_experts:
            body["return_routed_experts"] = True
        if req.top_logprobs_num:
            body["top_logprobs_num"] = req.top_logprobs_num
        if req.scores_input:  # prefill scoring (a teacher): logprobs of the input tokens too
            body["logprob_start_len"] = req.logprob_start_len
        if req.priority:  # a judge sharing the engines (reward.model.engine: shared) sends less than rollout's 0
            body["priority"] = req.priority
        if req.image_data:  # a vision-language prompt's images (SGLang's field)
            body["image_data"] = list(req.image_data)
        if req.adapter is not None:  # a served LoRA adapter, by name (SGLang's field)
            body["lora_path"] = req.adapter
        data = await self._call(self.http.generate(body, routing_key=req.routing_key))
        return output_from_sglang(data, req)

    async def abort(self, rid: str) -> None:
        """Abort request ``rid`` (``/abort_request``): its ``generate`` answers with the tokens so far
        (reason abort); an unknown or finished rid is ignored by the engine."""
        await self._post("/abort_request", {"rid": rid})

    async def pause(self, mode: str = "retract") -> None:
        await self._post("/pause_generation", {"mode": mode})

    async def load_adapter(self, name: str, folder: str, version: int) -> None:
        """Serve the peft folder ``folder`` (read by the engine: it must see this path) as LoRA adapter
        ``name`` at ``version`` (``/load_lora_adapter``, SGLang's and vLLM's route)."""
        await self._post("/load_lora_adapter", {"lora_name": name, "lora_path": folder, "version": version})

    async def adapters(self) -> dict[str, Any]:
        """The LoRA adapters the engine serves: name -> its record (``/lora_adapters``)."""
        response = await self._call(self.http.http.get("/lora_adapters"))
        if response.is_error:
            raise EngineFailure(f"{self.name}/lora_adapters answered {response.status_code}: {response.text[:300]}")
        return response.json()

    async def resume(self) -> None:
        await self._post("/continue_generation", {})

    async def release_memory(self, weights: bool = False) -> None:
        """``weights`` is for in-process engines only: an engine server keeps its weights."""
        await self._post("/release_memory_occupation", {}, missing_ok=True)

    async def resume_memory(self) -> None:
        await self._post("/resume_memory_occupation", {}, missing_ok=True)

    async def weight_version(self) -> int:
        response = await self._call(self.http.http.get("/get_weight_version"))
        if response.is_error:
            raise EngineFailure(f"{self.name}/get_weight_version answered {response.status_code}: {response.text[:300]}")
        return parse_version(response.json().get("weight_version"), self.name)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def _post(self, path: str, body: dict[str, Any], missing_ok: bool = False) -> Any:
        response = await self._call(self.http.http.post(path, json=body))
        if missing_ok and response.status_code == 404:
            return None
        if response.is_error:
            raise EngineFailure(f"{self.name}{path} answered {response.status_code}: {response.text[:500]}")
        return response.json()

    async def _call(self, awaitable: Any) -> Any:
        try:
            return await awaitable
        except httpx.HTTPStatusError as e:
            raise EngineFailure(f"{self.name}: {e}") from e
        except httpx.TimeoutException as e:  # alive or not, it did not answer in time (stopped, hung, overloaded)
            raise EngineFailure(
                f"{self.name}: no answer within rollout.engine_timeout_s={self.timeout_s:g} s ({type(e).__name__})"
                f"{await self._exit_note()}"
            ) from e
        except (httpx.TransportError, OSError) as e:
            raise EngineFailure(f"{self.name} is unreachable ({type(e).__name__}: {e}){await self._exit_note()}") from e

    async def _exit_note(self, grace_s: float = 2.0) -> str:
        """How this run's engine process ended, if it did: a connection cut by a dying process can
        arrive before the process is reaped, so it is given ``grace_s`` to show its exit code."""
        if self.process is None:
            return ""
        try:
            code = await asyncio.to_thread(self.process.wait, grace_s)
        except subprocess.TimeoutExpired:
            return ""
        return f"; its process exited with code {code}"


def sampling_dict(req: GenerateRequest) -> dict[str, Any]:
    """SGLang's ``sampling_params`` for ``req`` (defaults left out)."""
    s = req.sampling
    out: dict[str, Any] = {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature}
    for key, default in (("top_p", 1.0), ("top_k", -1), ("min_p", 0.0), ("ignore_eos", False)):
        if getattr(s, key) != default:
            out[key] = getattr(s, key)
    if s.seed is not None:  # SGLang's name: sglang-router drops a field it does not know (``seed``)
        out["sampling_seed"] = s.seed
    if s.stop:
        out["stop"] = list(s.stop)
    if s.stop_token_ids:
        out["stop_token_ids"] = list(s.stop_token_ids)
    return out


def output_from_sglang(data: dict[str, Any], req: GenerateRequest) -> GenerateOutput:
    """An SGLang ``/generate`` response -> ``GenerateOutput`` (per-token versions filled in)."""
    info = data.get("meta_info", {})
    ids = list(data.get("output_ids", []))
    logprobs = [float(entry[0]) for entry in info.get("output_token_logprobs", [])]
    if len(logprobs) != len(ids):
        raise EngineFailure(
            f"engine answered {len(ids)} output ids but {len(logprobs)} logprobs (was return_logprob honoured?)"
        )
    versions = info.get("weight_versions")
    if versions is None:  # SGLang: one version (a string such as "3") for the whole request
        versions = [response_version(info)] * len(ids)
    routes = decode_routes(info, len(ids)) if req.return_routed_experts else None
    if req.return_routed_experts and ids and (routes is None or len(routes) != len(ids)):
        raise EngineFailure(
            f"engine answered {len(ids)} output ids but no routed_experts for each (is it a MoE model, and an "
            "SGLang server started with --enable-return-routed-experts?)"
        )
    scored = scored_input(info, req)
    return GenerateOutput(
        rid=str(info.get("id", req.rid)),
        output_ids=ids,
        logprobs=logprobs,
        weight_versions=[int(v) for v in versions],
        text=data.get("text", ""),
        finish_reason=info.get("finish_reason"),
        prompt_tokens=int(info.get("prompt_tokens", len(req.input_ids))),
        cached_tokens=int(info.get("cached_tokens", 0)),
        routed_experts=routes,
        top_logprobs=_top(info.get("output_top_logprobs")) if req.top_logprobs_num else None,
        input_ids=list(req.input_ids) if scored[0] is not None else [],
        input_logprobs=scored[0],
        input_top_logprobs=scored[1],
        adapter=info.get("adapter"),
        adapter_version=info.get("adapter_version"),
    )


def response_version(info: dict[str, Any]) -> int:
    """The one weight version of an SGLang answer (``meta_info.weight_version``, a string); a missing
    or non-numeric one is an ``EngineFailure``: a token of unknown version can never be trained on
    (the connect-time check, ``noria.rollout.capabilities``, makes this rare)."""
    try:
        return parse_version(info.get("weight_version"), "engine answer")
    except NoriaError as e:
        raise EngineFailure(f"{e}: cannot tell which weights produced these tokens") from e


def scored_input(info: dict[str, Any], req: GenerateRequest) -> tuple[list | None, list | None]:
    """(input logprobs, input top logprobs) of a prefill-scoring answer (``logprob_start_len``), checked
    to cover the prompt from that position on; (None, None) when the request did not ask."""
    if not req.scores_input:
        return None, None
    entries = info.get("input_token_logprobs")
    want = len(req.input_ids) - req.logprob_start_len
    if entries is None or len(entries) != want:
        got = "none" if entries is None else len(entries)
        raise EngineFailure(
            f"engine answered {got} input_token_logprobs for logprob_start_len={req.logprob_start_len} of a "
            f"{len(req.input_ids)}-token input (expected {want}): does it support prefill scoring?"
        )
    logprobs = [None if e[0] is None else float(e[0]) for e in entries]
    tops = _top(info.get("input_top_logprobs")) if req.top_logprobs_num else None
    return logprobs, tops


def _top(steps: list | None) -> list | None:
    """SGLang's ``[[logprob, token_id, text], ...]`` per position -> ``[(token_id, logprob), ...]``."""
    if steps is None:
        return None
    return [None if step is None else [(int(e[1]), float(e[0])) for e in step] for step in steps]
