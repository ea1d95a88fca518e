"""What an engine server can do, learned when the run connects to it, and the configs it cannot run.

What this module owns: ``EngineCapabilities`` (a typed record), how it is learned from a server
(``negotiate``: ``noria serve`` and SGLang through SGLang's ``/server_info`` and
``/get_weight_version``; vLLM through ``/version`` and the routes its ``/openapi.json`` lists), and
``check_capabilities``: the refusal, before any model loads on the trainer, of a config that needs
something the engine lacks, with an error naming the capability and the config key.

=====================  =====================  ============================  ===========================
capability             noria serve            SGLang                        vLLM (OpenAI server)
=====================  =====================  ============================  ===========================
sampled-token          yes                    yes (``return_logprob``)      yes (``logprobs: 0``; start it
logprobs                                                                    with ``--logprobs-mode
                                                                            processed_logprobs``)
routed experts         yes (MoE)              ``enable_return_routed_       no (Noria does not read
                                              experts`` in /server_info     vLLM's encoding)
pause modes            retract, in_place      retract, in_place             drain (Noria's own gate)
weight transports      ipc, broadcast, disk   broadcast, disk               disk (``/collective_rpc``
                                                                            ``reload_weights``; needs
                                                                            ``VLLM_SERVER_DEV_MODE=1``)
per-request versions   yes                    yes (``--weight-version N``)  no: Noria tags each request
                                                                            with the version current
                                                                            when it was admitted
checksums (verify)     yes                    no                            no
disk deltas            yes                    no                            no
deterministic          ``engine.deterministic``  ``enable_deterministic_    no
                       when started so        inference`` in /server_info
=====================  =====================  ============================  ===========================

A version an engine reports must be an integer (SGLang's ``weight_version`` is a string: ``"3"``
is read as 3); a missing or non-numeric one (SGLang's default ``"default"``) is an error here, at
connect time, never a silent -1 later.

Blocking: ``negotiate`` makes a few synchronous HTTP calls (``timeout_s`` each). Not guaranteed:
that a server keeps what it announced (a server restarted with other flags is not re-asked), or
that a vLLM server started by the user computes logprobs after the temperature (its
``--logprobs-mode`` is not reported; the run's ``rollout_logprob_abs_diff`` shows a wrong one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from noria.errors import NoriaError

ENGINE_APIS = ("noria", "sglang", "vllm")
"""``rollout.engine``: the built-in engine (``noria serve``), an SGLang server, a vLLM server."""


class MissingCapability(NoriaError):
    """The config needs something the engine does not offer; the message names both."""


@dataclass(frozen=True)
class EngineCapabilities:
    """What one engine server offers, as learned at connect time."""

    api: str
    """Which HTTP API it speaks: ``noria`` (noria serve), ``sglang`` or ``vllm``."""
    name: str
    """The engine in errors (its base URL and, where it says, its version)."""
    logprobs: bool
    """It returns the log-probability of every sampled token."""
    routed_experts: bool
    """It returns the MoE experts each output token was routed to (``rollout.routing_replay``)."""
    pause_modes: tuple[str, ...]
    """``rollout.pause_mode`` values it can take a weight update under."""
    weight_transports: tuple[str, ...]
    """``sync.transport`` values it can load weights through."""
    reports_versions: bool
    """It reports the weight version that served each request; else Noria tags requests itself."""
    checksums: bool
    """It reports per-tensor checksums of its weights (``sync.verify``)."""
    deterministic: bool
    """It runs batch-invariant, bitwise-reproducible numerics (``engine.deterministic``)."""
    disk_deltas: bool = False
    """It applies weight deltas written by the disk transport (``sync.delta``); else only full folders."""
    weight_version: int | None = None
    """The version it serves now (None where it reports none)."""


def negotiate(base_url: str, api: str, api_key: str | None = None, timeout_s: float = 30.0) -> EngineCapabilities:
    """Ask the server at ``base_url`` (speaking ``api``) what it supports; raises ``MissingCapability``
    for a server that cannot be used at all (no numeric version, no completions route)."""
    if api not in ENGINE_APIS:
        raise NoriaError(f"rollout.engine must be one of {ENGINE_APIS}, got {api!r}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s) as http:
        try:
            return probe_vllm(http) if api == "vllm" else probe_sglang(http)
        except httpx.HTTPError as e:
            raise NoriaError(f"engine at {base_url}: capability check failed: {type(e).__name__}: {e}") from e


def probe_sglang(http: httpx.Client) -> EngineCapabilities:
    """``noria serve`` or SGLang: ``/server_info`` (older SGLang: ``/get_server_info``) and the version."""
    name = f"engine at {http.base_url}"
    info = _get_json(http, "/server_info") or _get_json(http, "/get_server_info")
    if info is None:
        raise MissingCapability(f"{name} answers neither /server_info nor /get_server_info: not an SGLang-API server")
    version = parse_version(_get_json(http, "/get_weight_version", required=True).get("weight_version"), name)
    if info.get("version") == "noria":
        engine = info.get("engine_config") or {}
        return EngineCapabilities(
            api="noria", name=f"{name} (noria serve)", logprobs=True, routed_experts=True,
            pause_modes=("retract", "in_place"), weight_transports=("ipc", "broadcast", "disk"), reports_versions=True,
            checksums=True, deterministic=bool(engine.get("deterministic")), weight_version=version, disk_deltas=True,
        )  # fmt: skip
    return EngineCapabilities(
        api="sglang", name=f"{name} (SGLang {info.get('version', '?')})", logprobs=True,
        routed_experts=bool(info.get("enable_return_routed_experts")), pause_modes=("retract", "in_place"),
        weight_transports=("broadcast", "disk"), reports_versions=True, checksums=False,
        deterministic=bool(info.get("enable_deterministic_inference")), weight_version=version,
    )  # fmt: skip


def probe_vllm(http: httpx.Client) -> EngineCapabilities:
    """A vLLM OpenAI server: its version and the routes it serves (``/openapi.json``)."""
    version = (_get_json(http, "/version") or {}).get("version", "?")
    name = f"engine at {http.base_url} (vLLM {version})"
    spec = _get_json(http, "/openapi.json")
    if spec is None:
        raise MissingCapability(f"{name}: no /openapi.json, so its routes cannot be learned")
    paths = set(spec.get("paths", {}))
    if "/v1/completions" not in paths:
        raise MissingCapability(f"{name} serves no /v1/completions (token-id prompts with logprobs): not a generation server")
    reload = {"/collective_rpc", "/update_weight_version", "/weight_info"} <= paths
    return EngineCapabilities(
        api="vllm", name=name, logprobs=True, routed_experts=False, pause_modes=("drain",),
        weight_transports=("disk",) if reload else (), reports_versions=False, checksums=False, deterministic=False,
    )  # fmt: skip


def parse_version(value: Any, engine: str) -> int:
    """An engine's weight version as an integer: ints as they are, SGLang's digit strings read;
    anything else (missing, ``"default"``, a float) raises, naming the engine."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    hint = " (start SGLang with --weight-version 0 so that Noria's versions are integers)" if value in (None, "default") else ""
    raise MissingCapability(f"{engine} reports weight version {value!r}, not an integer{hint}")


def check_capabilities(config: Any, caps: EngineCapabilities, transport: str) -> None:
    """Refuse ``config`` (a ``RunConfig``) when it needs what ``caps`` lacks; ``transport`` is the
    resolved ``sync.transport``. The error names the engine, the capability and the config key."""
    needs = [
        (True, caps.logprobs, "sampled-token logprobs", "RL itself (the trainer's importance ratios)"),
        (config.rollout.wants_routes, caps.routed_experts, "routed experts",
         "rollout.routing_replay / rollout.record_routes"),
        (config.engine.deterministic, caps.deterministic, "deterministic numerics", "engine.deterministic"),
        (True, config.rollout.pause_mode in caps.pause_modes,
         f"pause mode {config.rollout.pause_mode!r} (it has: {', '.join(caps.pause_modes) or 'none'})", "rollout.pause_mode"),
        (True, transport in caps.weight_transports,
         f"weight updates by {transport!r} (it has: {', '.join(caps.weight_transports) or 'none'})", "sync.transport"),
        (config.sync.verify, caps.checksums, "weight checksums", "sync.verify"),
        (getattr(config.sync, "delta", False), caps.disk_deltas, "weight deltas (it loads only full folders)", "sync.delta"),
    ]  # fmt: skip
    for wanted, offered, capability, key in needs:
        if wanted and not offered:
            raise MissingCapability(f"{caps.name} lacks {capability}, which {key} needs{_hint(caps, key)}")


def _hint(caps: EngineCapabilities, key: str) -> str:
    if caps.api == "vllm" and key == "sync.transport" and not caps.weight_transports:
        return ": start the vLLM server with VLLM_SERVER_DEV_MODE=1 (it then serves /collective_rpc reload_weights)"
    if caps.api == "vllm" and key == "rollout.pause_mode":
        return ": set rollout.pause_mode: drain (vLLM does not report which version served a request)"
    return ""


def _get_json(http: httpx.Client, path: str, required: bool = False) -> dict[str, Any] | None:
    response = http.get(path)
    if response.status_code == 404 and not required:
        return None
    if response.is_error:
        raise MissingCapability(f"engine at {http.base_url}: GET {path} answered {response.status_code}: {response.text[:300]}")
    return response.json()
