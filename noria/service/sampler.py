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

``service.placement: disaggregated`` puts the engine in a process of its own (``HttpSampler``): a
``noria serve`` child started through the launcher every run uses (``noria.engine.child``), or the
server at ``service.engine_url``. It is driven through its SGLang-style HTTP API with the rollout's
client (``noria.rollout.client.HttpEngineClient``): an adapter version is written as a peft folder
under ``service.state_dir``, loaded with ``/load_lora_adapter`` (the folder removed once the engine
has read it) and named by ``/generate``'s ``lora_path``. The service's process then holds no
engine, and the engine's decoding runs beside the trainer's steps rather than between them under one
GIL. A dead or unanswering engine fails the sample with an error naming it; training goes on.

Not guaranteed: an adapter may be evicted between two samples (it is loaded again, costing a
copy); with every engine slot held by running requests a sample fails (retry it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import shutil
import threading
import uuid
from pathlib import Path

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
        name = current_name(adapter)
        if name not in self.engine.adapters():
            tensors = {n: t.detach().clone() for n, t in lora.peft_tensors(adapter)}
            config = {"r": adapter.spec.rank, "lora_alpha": adapter.spec.alpha, "target_modules": list(adapter.spec.target_modules)}
            self.engine.load_adapter(name, tensors, version=adapter.version, config=config)
        return name

    def saved(self, tenant: str, path: str, folder) -> str:
        """The engine's name of a saved sampler folder, loaded if the engine lacks it."""
        name = saved_name(tenant, path)
        if name not in self.engine.adapters():
            self.engine.load_adapter(name, str(folder))
        return name

    def sample(self, prompt: list[int], params: dict, num_samples: int, adapter: str | None) -> concurrent.futures.Future:
        """Submit ``num_samples`` requests; a future of Tinker's ``SampleResponse`` JSON."""
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
                try:
                    done.set_result(sample_response(outputs))
                except RuntimeError as e:
                    done.set_exception(e)

        for i, req in enumerate(requests(prompt, params, num_samples, adapter)):
            self.engine.submit(req, lambda out, i=i: finished(i, out))
        return done

    def shutdown(self) -> None:
        self.engine.shutdown(drain_timeout_s=5.0)


class HttpSampler:
    """The engine as a server of its own (``service.placement: disaggregated``): the same calls as
    ``Sampler``, over HTTP. ``folder`` is where adapter versions are written for the engine to read;
    ``process`` the ``noria serve`` child this service started (stopped by ``shutdown``), or None."""

    def __init__(self, url: str, api_key: str | None, folder: Path, process=None, timeout_s: float = 600.0) -> None:
        from noria.rollout.client import HttpEngineClient

        self.folder, self.process = Path(folder), process
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="noria-service-sampler", daemon=True)
        self.thread.start()
        self.client = HttpEngineClient(url, api_key=api_key, timeout_s=timeout_s, process=process)

    @classmethod
    def start(cls, path: str, config) -> HttpSampler:
        """``service.engine_url``, or a ``noria serve`` child of ``path`` with the service's ``engine.*``
        keys, dtype and device, waited for until it answers."""
        state = Path(config.service.state_dir)
        folder = state / ".engine-adapters"
        if config.service.engine_url is not None:
            sampler = cls(config.service.engine_url, None, folder)
            try:  # an engine that is not there, or serves no LoRA adapters, stops the start naming it
                sampler._run(sampler.client.adapters())
            except BaseException:
                sampler.shutdown()
                raise
            return sampler
        from noria.engine.child import start_engine_server

        state.mkdir(parents=True, exist_ok=True)
        child, url, key = start_engine_server(Path(path), config, state, device=config.model.device)
        return cls(url, key, folder, process=child)

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def current(self, lora: MultiLora, adapter: Adapter) -> str:
        name = current_name(adapter)
        if name not in self._run(self.client.adapters()):
            folder = self.folder / name
            lora.save_peft(adapter, folder)
            try:
                self._run(self.client.load_adapter(name, str(folder.resolve()), adapter.version))
            finally:
                shutil.rmtree(folder, ignore_errors=True)  # the engine holds the tensors once loaded
        return name

    def saved(self, tenant: str, path: str, folder) -> str:
        name = saved_name(tenant, path)
        if name not in self._run(self.client.adapters()):
            self._run(self.client.load_adapter(name, str(Path(folder).resolve()), 0))
        return name

    def sample(self, prompt: list[int], params: dict, num_samples: int, adapter: str | None) -> concurrent.futures.Future:
        async def run() -> dict:
            reqs = requests(prompt, params, num_samples, adapter)
            return sample_response(await asyncio.gather(*(self.client.generate(r) for r in reqs)))

        return asyncio.run_coroutine_threadsafe(run(), self.loop)

    def shutdown(self) -> None:
        try:
            self._run(self.client.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5.0)
            if not self.thread.is_alive():
                self.loop.close()
            if self.process is not None:
                self.process.stop()


def current_name(adapter: Adapter) -> str:
    """The engine's name of a training client's current weights: one per version."""
    return f"{adapter.name}@{adapter.version}"


def saved_name(tenant: str, path: str) -> str:
    """The engine's name of a tenant's saved sampler weights."""
    return f"{tenant}:{path}"


def requests(prompt: list[int], params: dict, num_samples: int, adapter: str | None) -> list:
    """The engine requests of one sample call: ``num_samples`` rows of ``prompt`` on ``adapter``."""
    from noria.engine.protocol import GenerateRequest, SamplingParams

    out = []
    for i in range(num_samples):
        p = dict(params)
        if p.get("seed") is not None:
            p["seed"] = p["seed"] + i  # distinct samples of one call, reproducible as a whole
        out.append(GenerateRequest(input_ids=list(prompt), sampling=SamplingParams.from_dict(p), rid=f"s-{uuid.uuid4().hex}", adapter=adapter))
    return out


def sample_response(outputs: list) -> dict:
    """Tinker's ``SampleResponse`` JSON of a call's engine outputs; ``RuntimeError`` if one was aborted."""
    aborted = [o for o in outputs if (o.finish_reason or {}).get("type") == "abort"]
    if aborted:
        raise RuntimeError(f"sample aborted by the engine: {aborted[0].finish_reason.get('message')}")
    sequences = [
        {"tokens": o.output_ids, "logprobs": o.logprobs, "stop_reason": "length" if o.finish_reason["type"] == "length" else "stop",
         "adapter_version": o.adapter_version}
        for o in outputs
    ]  # fmt: skip
    return {"type": "sample", "sequences": sequences, "prompt_logprobs": None}
