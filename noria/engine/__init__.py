"""The built-in rollout engine: continuous batching over a paged KV cache with a radix prefix cache.

Modules, from the caller inwards::

    engine.py     Engine: the asyncio/thread API, the step loop, memory, metrics
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

from noria.engine.engine import Engine, EngineDead
from noria.engine.protocol import GenerateOutput, GenerateRequest, RequestError, SamplingParams
from noria.engine.weights import WeightUpdateError

__all__ = [
    "Engine",
    "EngineDead",
    "GenerateOutput",
    "GenerateRequest",
    "RequestError",
    "SamplingParams",
    "WeightUpdateError",
]
