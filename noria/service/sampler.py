"""Sampling for ``noria service``: Noria's built-in engine, one adapter per request row.

The engine (``noria.engine.Engine``) holds its own copy of the base model and serves many LoRA
adapters at once in one continuous batch (``GenerateRequest.adapter``; ``engine.lora_max_adapters``
slots, least recently used evicted). A ``sample`` call names where its weights come from:

- ``model_id``: the training client's CURRENT weights. They enter the engine as the adapter
  ``<model_id>@<version>``, the version growing at every optim_step and load_state, so a sequence
  is sampled with one version throughout, and a client may sample version k while k+1 trains;
- ``model_path``: weights saved by ``save_weights_for_sampler`` (a peft folder), loaded once as
  ``<tenant>:<path>``;
- neither: the base model.

Loading runs on the service's worker thread (it reads the training parameters, which only that
thread touches), then the requests go to the engine and the call's future resolves when the last
sample finishes: training calls queued behind it run meanwhile. Each returned token carries the
engine's logprob (``log_softmax(logits / T)``, the quantity ``forward`` recomputes at T = 1).

Not guaranteed: an adapter may be evicted between two samples (it is loaded again, costing a
copy); with every engine slot held by running requests a sample fails (retry it).
"""

from __future__ import annotations

import concurrent.futures
import threading
import uuid

from noria.service.adapters import Adapter, MultiLora
from noria.service.wire import BadRequest

TINKER_SAMPLING = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop"}


def sampling_params(raw: object, num_samples: object) -> tuple[dict, int]:
    """Tinker's ``sampling_params`` as the engine's ``SamplingParams`` fields, and the sample count."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params: needs an object")
    unknown = sorted(set(raw) - TINKER_SAMPLING)
    if unknown:
        raise BadRequest(f"sampling_params: unknown fields {unknown}; known: {sorted(TINKER_SAMPLING)}")
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or not 1 <= num_samples <= 256:
        raise BadRequest(f"num_samples: needs an integer in [1, 256], got {num_samples!r}")
    params: dict = {"max_new_tokens": raw.get("max_tokens") or 128}
    for key in ("temperature", "top_p", "top_k", "seed"):
        if raw.get(key) is not None:
            params[key] = raw[key]
    stop = raw.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop:
        if not isinstance(stop, list):
            raise BadRequest("sampling_params.stop: a string, a list of strings or a list of token ids")
        key = "stop_token_ids" if all(isinstance(s, int) for s in stop) else "stop"
        params[key] = stop
    from noria.engine.protocol import RequestError, SamplingParams

    try:
        SamplingParams.from_dict(params)
    except RequestError as e:
        raise BadRequest(str(e)) from None
    return params, num_samples


class Sampler:
    """The engine, and which adapter name holds which weights."""

    def __init__(self, engine) -> None:
        self.engine = engine

    @classmethod
    def load(cls, path: str, engine_config, dtype: str, device: str) -> Sampler:
        from noria.engine.engine import Engine

        return cls(Engine.from_path(path, engine_config, dtype=dtype, device=device))

    def current(self, lora: MultiLora, adapter: Adapter) -> str:
        """The engine's name of the adapter's current weights, loaded if the engine lacks them."""
        name = f"{adapter.name}@{adapter.version}"
        if name not in self.engine.adapters():
            tensors = {n: t.detach().clone() for n, t in lora.peft_tensors(adapter)}
            config = {"r": adapter.spec.rank, "lora_alpha": adapter.spec.alpha, "target_modules": list(adapter.spec.target_modules)}
            self.engine.load_adapter(name, tensors, version=adapter.version, config=config)
        return name

    def saved(self, tenant: str, path: str, folder) -> str:
        """The engine's name of a saved sampler folder, loaded if the engine lacks it."""
        name = f"{tenant}:{path}"
        if name not in self.engine.adapters():
            self.engine.load_adapter(name, str(folder))
        return name

    def sample(self, prompt: list[int], params: dict, num_samples: int, adapter: str | None) -> concurrent.futures.Future:
        """Submit ``num_samples`` requests; a future of Tinker's ``SampleResponse`` JSON."""
        from noria.engine.protocol import GenerateRequest, SamplingParams

        done: concurrent.futures.Future = concurrent.futures.Future()
        outputs: list = [None] * num_samples
        left = [num_samples]
        lock = threading.Lock()

        def finished(i: int, out) -> None:
            with lock:
                outputs[i] = out
                left[0] -= 1
                last = left[0] == 0
            if last:
                _resolve(done, outputs)

        for i in range(num_samples):
            p = dict(params)
            if p.get("seed") is not None:
                p["seed"] = p["seed"] + i  # distinct samples of one call, reproducible as a whole
            req = GenerateRequest(input_ids=list(prompt), sampling=SamplingParams.from_dict(p), rid=f"s-{uuid.uuid4().hex}", adapter=adapter)
            self.engine.submit(req, lambda out, i=i: finished(i, out))
        return done

    def shutdown(self) -> None:
        self.engine.shutdown(drain_timeout_s=5.0)


def _resolve(done: concurrent.futures.Future, outputs: list) -> None:
    aborted = [o for o in outputs if (o.finish_reason or {}).get("type") == "abort"]
    if aborted:
        done.set_exception(RuntimeError(f"sample aborted by the engine: {aborted[0].finish_reason.get('message')}"))
        return
    sequences = [
        {"tokens": o.output_ids, "logprobs": o.logprobs, "stop_reason": "length" if o.finish_reason["type"] == "length" else "stop",
         "adapter_version": o.adapter_version}
        for o in outputs
    ]  # fmt: skip
    done.set_result({"type": "sample", "sequences": sequences, "prompt_logprobs": None})
