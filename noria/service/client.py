"""The Python client of ``noria service``: Tinker's training-client primitives, over HTTP.

    from noria.service.client import ServiceClient, datum

    service = ServiceClient("http://127.0.0.1:8000", api_key="tml-...")
    trainer = service.create_lora_training_client(rank=8)
    fb = trainer.forward_backward([datum(tokens, targets, weights=w)], "cross_entropy")
    opt = trainer.optim_step({"learning_rate": 1e-3})       # queued behind fb: both run in order
    print(fb.result()["metrics"]["loss:sum"], opt.result())
    path = trainer.save_state("step-1").result()["path"]    # tinker://<model_id>/weights/step-1

Every primitive returns an ``APIFuture`` at once (the call is queued on the service); ``result()``
polls ``retrieve_future`` until the call has run, and raises ``RequestFailed`` when it failed on
the service (``category`` user: the request's fault, e.g. a non-finite loss; server: a bug). A
refused request raises ``ServiceError`` with the HTTP status (400 bad body, 401 / 403 key, 404 not
the tenant's, 429 quota with ``retry_after_s``). The client never retries: a 429 is the caller's
to wait out. One ``httpx.Client`` per ``ServiceClient``; it is safe to use from several threads. The client
imports neither torch nor the rest of Noria's training code: it runs where only httpx is installed.
"""

from __future__ import annotations

import time
from typing import Any

import httpx


__all__ = ["APIFuture", "RequestFailed", "SamplingClient", "ServiceClient", "ServiceError", "TrainingClient", "datum", "text_input"]


class ServiceError(Exception):
    """A request the service refused: ``status`` (400, 401, 403, 404, 429, 500) and its message."""

    def __init__(self, status: int, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message, self.retry_after_s = status, message, retry_after_s


class RequestFailed(Exception):
    """A queued call that failed on the service; ``category`` is user or server."""

    def __init__(self, message: str, category: str) -> None:
        super().__init__(message)
        self.category = category


class ServiceClient:
    """One tenant's connection to a ``noria service``."""

    def __init__(self, base_url: str, api_key: str, timeout_s: float = 120.0) -> None:
        self.http = httpx.Client(base_url=base_url.rstrip("/") + "/api/v1", headers={"X-API-Key": api_key}, timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def post(self, route: str, body: dict) -> dict:
        """POST a JSON body; the JSON answer, or ``ServiceError``."""
        return _answer(self.http.post(f"/{route}", json=body))

    def submit(self, route: str, body: dict) -> APIFuture:
        return APIFuture(self, self.post(route, body)["request_id"])

    def get_server_capabilities(self) -> dict:
        return _answer(self.http.get("/get_server_capabilities"))

    def create_lora_training_client(self, base_model: str | None = None, rank: int = 32, **lora_config: Any) -> TrainingClient:
        """A new adapter on the base model (``lora_config``: train_attn, train_mlp, target_modules, seed)."""
        body: dict[str, Any] = {"lora_config": {"rank": rank, **lora_config}}
        if base_model is not None:
            body["base_model"] = base_model
        created = self.submit("create_model", body).result()
        return TrainingClient(self, created["model_id"])

    def create_sampling_client(self, model_path: str | None = None) -> SamplingClient:
        """Sampling from weights saved by ``save_weights_for_sampler`` (None: the base model)."""
        return SamplingClient(self, model_path=model_path)

    def create_training_client_from_state(self, path: str, with_optimizer: bool = True) -> TrainingClient:
        """A new training client with the LoRA config of a saved state, loaded from it (a restarted
        service included: saved states outlive it)."""
        info = self.post("saved_state_info", {"path": path})
        trainer = self.create_lora_training_client(rank=info["rank"], target_modules=info["target_modules"], seed=info["seed"])
        trainer.load_state(path, with_optimizer).result()
        return trainer


class SamplingClient:
    """Samples from saved sampler weights (``model_path``), or the base model (None)."""

    def __init__(self, client: ServiceClient, model_path: str | None = None, model_id: str | None = None) -> None:
        self.client, self.model_path, self.model_id = client, model_path, model_id

    def sample(self, prompt: list[int], num_samples: int = 1, sampling_params: dict | None = None) -> APIFuture:
        """``num_samples`` continuations of the prompt's token ids; the result's ``sequences`` hold
        each one's ``tokens``, ``logprobs`` and ``stop_reason`` (Tinker's SampleResponse).
        ``sampling_params``: max_tokens, temperature, top_p, top_k, seed, stop."""
        body: dict[str, Any] = {"prompt": text_input(prompt), "num_samples": num_samples, "sampling_params": sampling_params or {}}
        if self.model_path is not None:
            body["model_path"] = self.model_path
        if self.model_id is not None:
            body["model_id"] = self.model_id
        return self.client.submit("asample", body)


class APIFuture:
    """A queued call; ``result()`` waits for it."""

    def __init__(self, client: ServiceClient, request_id: str) -> None:
        self.client, self.request_id = client, request_id

    def result(self, timeout_s: float | None = None) -> dict:
        """The call's result; ``RequestFailed`` if it failed, ``TimeoutError`` after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pause = 0.002
        while True:
            answer = self.client.post("retrieve_future", {"request_id": self.request_id})
            if answer.get("type") == "request_failed":
                raise RequestFailed(answer["error"], answer.get("category", "server"))
            if answer.get("type") != "try_again":
                return answer
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"future {self.request_id} not done after {timeout_s} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.1)


class TrainingClient:
    """One adapter (a ``model_id``) of the tenant: the training primitives, each a future."""

    def __init__(self, client: ServiceClient, model_id: str) -> None:
        self.client, self.model_id = client, model_id

    def forward_backward(self, data: list[dict], loss_fn: str, loss_fn_config: dict | None = None) -> APIFuture:
        """Loss and gradient of ``data`` (added to the adapter's); per-token logprobs in the result."""
        fb = {"data": data, "loss_fn": loss_fn, "loss_fn_config": loss_fn_config}
        return self.client.submit("forward_backward", {"model_id": self.model_id, "forward_backward_input": fb})

    def forward(self, data: list[dict], loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None) -> APIFuture:
        """Per-token logprobs and the loss of ``data``, without a gradient."""
        fwd = {"data": data, "loss_fn": loss_fn, "loss_fn_config": loss_fn_config}
        return self.client.submit("forward", {"model_id": self.model_id, "forward_input": fwd})

    def optim_step(self, adam_params: dict | None = None) -> APIFuture:
        """One Adam step on the gradients since the last (``adam_params``: Tinker's AdamParams)."""
        return self.client.submit("optim_step", {"model_id": self.model_id, "adam_params": adam_params or {}})

    def save_state(self, name: str) -> APIFuture:
        """Weights and optimizer state as ``tinker://<model_id>/weights/<name>``."""
        return self.client.submit("save_weights", {"model_id": self.model_id, "path": name})

    def load_state(self, path: str, with_optimizer: bool = True) -> APIFuture:
        """Weights (and optimizer state) of a saved state of this tenant."""
        return self.client.submit("load_weights", {"model_id": self.model_id, "path": path, "optimizer": with_optimizer})

    def save_weights_for_sampler(self, name: str) -> APIFuture:
        """The adapter as a peft folder, ``tinker://<model_id>/sampler_weights/<name>``."""
        return self.client.submit("save_weights_for_sampler", {"model_id": self.model_id, "path": name})

    def sampling_client(self) -> SamplingClient:
        """Samples from this adapter's CURRENT weights (each call those of the latest optim_step
        before it in this client's order)."""
        return SamplingClient(self.client, model_id=self.model_id)

    def save_weights_and_get_sampling_client(self, name: str) -> SamplingClient:
        """Save the weights for the sampler and sample from that saved copy."""
        return SamplingClient(self.client, model_path=self.save_weights_for_sampler(name).result()["path"])

    def get_info(self) -> dict:
        return self.client.post("get_info", {"model_id": self.model_id})

    def unload(self) -> APIFuture:
        """Drop the adapter (and free one of the tenant's adapter quota)."""
        return self.client.submit("unload_model", {"model_id": self.model_id})


def text_input(tokens: list[int]) -> dict:
    """Token ids as Tinker's ``ModelInput`` of one text chunk."""
    return {"chunks": [{"type": "encoded_text", "tokens": [int(t) for t in tokens]}]}


def datum(tokens: list[int], target_tokens: list[int], **inputs: list[float]) -> dict:
    """A datum's JSON: input tokens, the targets (one per input position: ``target_tokens[i]`` is
    predicted after ``tokens[: i + 1]``) and float loss inputs (weights, advantages, logprobs)."""
    out: dict[str, dict] = {"target_tokens": {"data": [int(t) for t in target_tokens], "dtype": "int64", "shape": [len(target_tokens)]}}
    for k, v in inputs.items():
        out[k] = {"data": [float(x) for x in v], "dtype": "float32", "shape": [len(v)]}
    return {"model_input": text_input(tokens), "loss_fn_inputs": out}


def _answer(response: httpx.Response) -> dict:
    if response.status_code == 200:
        return response.json()
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    retry = response.headers.get("Retry-After")
    raise ServiceError(response.status_code, message, float(retry) if retry else None)
