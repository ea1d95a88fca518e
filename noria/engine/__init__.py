"""The built-in rollout engine: continuous batching over a paged KV cache with a radix prefix cache.

Modules, from the caller inwards::

    engine.py     Engine: the asyncio/thread API, the step loop, memory, metrics
    thread.py     EngineThread (the engine thread and its command inbox), generate / generate_batch
    weight_updates.py  WeightUpdates (engine.weights): stage / commit / version / checksums / groups
    weights.py    the staging area (validation, stage then commit, shared arena) and checksums
    weight_sources.py  where updates come from: safetensors folder, IPC buffer, broadcast group
    server/       noria serve: SGLang's native API, weight API and OpenAI API over one Engine
    scheduler.py  request states, continuous batching, retraction, finish checks
    runner.py     one step -> one forward of the native model
    paged_context.py   the step's attention over the paged KV cache (PagedAttentionContext)
    inference.py  the runner's fast CPU forward: fused, prepacked bf16 matmuls (engine-only copies)
    sampling.py   per-row sampling and logprobs
    radix.py      prefix cache over KV blocks (LRU eviction)
    kv_cache.py   K/V pools and the reference-counted block allocator
    protocol.py   request/response records (SGLang's field names)

Quick use::

    engine = Engine.from_path("model-folder", EngineConfig())
    out = await engine.generate(GenerateRequest(input_ids=[...], sampling=SamplingParams(temperature=0)))
"""

from typing import Any

from noria.engine.engine import Engine
from noria.engine.hf_engine import HFEngine
from noria.engine.protocol import GenerateOutput, GenerateRequest, RequestError, SamplingParams
from noria.engine.thread import EngineDead
from noria.engine.weights import WeightUpdateError

__all__ = [
    "HFEngine",
    "in_process_engine",
    "serves_natively",
    "Engine",
    "EngineDead",
    "GenerateOutput",
    "GenerateRequest",
    "RequestError",
    "SamplingParams",
    "WeightUpdateError",
]


def serves_natively(path: Any, impl: str) -> bool:
    """Whether the built-in engine serves this model (a native family and ``model.impl`` not ``hf``);
    otherwise the generic transformers engine (``HFEngine``) does, in process only."""
    from noria.models.catalog import model_path
    from noria.models.checkpoint import read_config
    from noria.models.config import NATIVE_FAMILIES, VISION_FAMILIES

    return impl != "hf" and read_config(model_path(path)).get("model_type") in NATIVE_FAMILIES + VISION_FAMILIES


def in_process_engine(path: Any, config: Any, impl: str, dtype: str, device: str, seed: int) -> Any:
    """The engine for ``model.impl`` and the model's family: ``Engine`` (native, fast, exact mode)
    or ``HFEngine`` (any transformers causal LM: slower, no exactness claim)."""
    cls = Engine if serves_natively(path, impl) else HFEngine
    return cls.from_path(path, config, dtype=dtype, device=device, seed=seed)
