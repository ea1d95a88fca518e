"""The service's primitives, one method each: check the request, then queue its work as a future.

``Service`` ties the parts together: the base model and its adapters (``MultiLora``), the tenants
(``TenantRegistry``), the worker (``Scheduler``) and the saved states (``noria.service.state``).
Each method runs on the HTTP server's event loop, answers at once and does only cheap work there:
it finds the tenant's model (``NotFound`` for another tenant's), reads the body (``BadRequest``),
takes the quota (``QuotaExceeded``), then submits a closure that the worker thread runs.

Models are known by id from the moment ``create_model`` is accepted; their adapter exists once the
worker has run that call, and since a tenant's calls run in order, a ``forward_backward`` sent right
after ``create_model`` finds it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from noria.config import ServiceSection
from noria.errors import NoriaError
from noria.process.usage import release_free_memory
from noria.service import state, step
from noria.service.adapters import AdapterSpec, MultiLora, target_modules
from noria.service.scheduler import Scheduler
from noria.service.state import NotFound, check_name
from noria.service.tenants import Tenant, TenantRegistry
from noria.service.wire import BadRequest, read_data


@dataclass
class Model:
    """A training client: its id (also its adapter's name), owner and spec."""

    model_id: str
    tenant: str
    spec: AdapterSpec


class Service:
    """The primitives of the training API over one base model."""

    def __init__(self, lora: MultiLora, registry: TenantRegistry, cfg: ServiceSection, base_model: str, sampler=None) -> None:
        self.lora = lora
        self.sampler = sampler
        """``noria.service.sampler.Sampler`` (the engine), or None: ``sample`` is refused."""
        self.registry = registry
        self.cfg = cfg
        self.base_model = base_model
        self.state_dir = Path(cfg.state_dir)
        self.scheduler = Scheduler(registry, self.run_batch, cfg.batch_tokens)
        self.models: dict[str, Model] = {}
        self.vocab = int(lora.model.get_input_embeddings().weight.shape[0])

    def model(self, tenant: Tenant, model_id: object) -> Model:
        """The tenant's model ``model_id``; ``NotFound`` for any other (another tenant's included)."""
        model = self.models.get(model_id) if isinstance(model_id, str) else None
        if model is None or model.tenant != tenant.name:
            raise NotFound(f"model {model_id!r}: no such model of tenant {tenant.name}")
        return model

    def _adapter(self, model: Model):
        adapter = self.lora.adapters.get(model.model_id)
        if adapter is None:
            raise NotFound(f"model {model.model_id}: its adapter was not created (see the create_model future) or was unloaded")
        return adapter

    def create_model(self, tenant: Tenant, body: dict) -> str:
        base = body.get("base_model", self.base_model)
        if base != self.base_model:
            raise BadRequest(f"base_model {base!r}: this service trains {self.base_model!r} only")
        lora_config = body.get("lora_config") or {}
        if not isinstance(lora_config, dict):
            raise BadRequest("lora_config: needs an object")
        rank = lora_config.get("rank", 32)
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= self.cfg.max_rank:
            raise BadRequest(f"lora_config.rank: needs an integer in [1, {self.cfg.max_rank}], got {rank!r}")
        seed = lora_config.get("seed") or 0
        if not isinstance(seed, int):
            raise BadRequest(f"lora_config.seed: needs an integer, got {seed!r}")
        try:
            targets = target_modules(lora_config)
        except NoriaError as e:
            raise BadRequest(str(e)) from None
        spec = AdapterSpec(rank=rank, alpha=float(self.cfg.lora_alpha), target_modules=targets, seed=self.cfg.seed + seed)
        self.registry.take_adapter(tenant)
        model = Model(model_id="m" + uuid.uuid4().hex[:20], tenant=tenant.name, spec=spec)
        self.models[model.model_id] = model

        def work() -> dict:
            try:
                self.lora.add(model.model_id, tenant.name, spec)
            except Exception:
                self._forget(tenant, model)
                raise
            return {"type": "create_model", "model_id": model.model_id}

        return self._submit(tenant, "create_model", work)

    def _forget(self, tenant: Tenant, model: Model) -> None:
        self.models.pop(model.model_id, None)
        self.registry.release_adapter(tenant)

    def _submit(self, tenant: Tenant, kind: str, work, tokens: int = 0) -> str:
        return self.scheduler.submit(tenant, kind, work, tokens)

    def forward_backward(self, tenant: Tenant, body: dict, backward: bool = True) -> str:
        key = "forward_backward_input" if backward else "forward_input"
        model = self.model(tenant, body.get("model_id"))
        fb = body.get(key)
        if not isinstance(fb, dict):
            raise BadRequest(f"{key}: needs an object with data and loss_fn")
        from noria.service.losses import get_loss

        _, needs = get_loss(fb.get("loss_fn"))
        data = read_data(fb.get("data"), self.vocab, needs)
        config = fb.get("loss_fn_config") or {}
        if not isinstance(config, dict):
            raise BadRequest(f"{key}.loss_fn_config: needs an object")
        tokens = sum(len(d.tokens) for d in data)
        payload = (model, data, fb["loss_fn"], config, backward)
        return self.scheduler.submit(tenant, key.removesuffix("_input"), None, tokens, batch=payload)

    def run_batch(self, payloads: list[tuple]) -> list[step.Outcome]:
        """forward / forward_backward calls of several tenants run together (``step.run_calls``); the
        C heap's free pages go back to the kernel after them (``release_free_memory``), as after a
        trainer's step: the activations of a batch are gigabytes that the next call may not need."""
        outcomes: list[step.Outcome | None] = [None] * len(payloads)
        calls, where = [], []
        for i, (model, data, loss_name, config, backward) in enumerate(payloads):
            try:
                calls.append(step.Call(self._adapter(model), data, loss_name, config, backward))
                where.append(i)
            except NotFound as e:
                outcomes[i] = (None, e)
        for i, outcome in zip(where, step.run_calls(self.lora, calls, self.cfg.micro_batch_tokens) if calls else []):
            outcomes[i] = outcome
        release_free_memory()
        return outcomes

    def optim_step(self, tenant: Tenant, body: dict) -> str:
        model = self.model(tenant, body.get("model_id"))
        adam = step.read_adam(body.get("adam_params"))
        return self._submit(tenant, "optim_step", lambda: step.optim_step(self._adapter(model), adam))

    def save_weights(self, tenant: Tenant, body: dict, kind: str = "weights") -> str:
        """``save_state`` (kind ``weights``) or ``save_weights_for_sampler`` (``sampler_weights``)."""
        model = self.model(tenant, body.get("model_id"))
        name = body.get("path") or f"step-{uuid.uuid4().hex[:8]}"
        try:
            check_name(name, "path")
        except NoriaError as e:
            raise BadRequest(str(e)) from None
        folder = self.state_dir / tenant.name / model.model_id / kind / name
        path = f"{state.SCHEME}{model.model_id}/{kind}/{name}"

        def work() -> dict:
            adapter = self._adapter(model)
            if kind == "weights":
                state.save_state(adapter, folder, self.base_model)
            else:
                self.lora.save_peft(adapter, folder)
            return {"type": "save_weights" if kind == "weights" else "save_weights_for_sampler", "path": path}

        return self._submit(tenant, f"save_{kind}", work)

    def load_weights(self, tenant: Tenant, body: dict) -> str:
        model = self.model(tenant, body.get("model_id"))
        folder = self._saved_folder(tenant, body.get("path"), "weights",
                                    f"path {body.get('path')}: load_weights takes a saved state (/weights/), not sampler weights")
        with_optimizer = body.get("optimizer", True)
        if not isinstance(with_optimizer, bool):
            raise BadRequest("optimizer: needs true or false")

        def work() -> dict:
            state.load_state(self._adapter(model), folder, with_optimizer)
            return {"type": "load_weights", "path": body["path"]}

        return self._submit(tenant, "load_weights", work)

    def unload_model(self, tenant: Tenant, body: dict) -> str:
        model = self.model(tenant, body.get("model_id"))
        self.models.pop(model.model_id)

        def work() -> dict:
            try:
                if model.model_id in self.lora.adapters:
                    self.lora.remove(model.model_id)
            finally:
                self.registry.release_adapter(tenant)
            return {"type": "unload_model", "model_id": model.model_id}

        return self._submit(tenant, "unload_model", work)

    def get_info(self, tenant: Tenant, body: dict) -> dict:
        model = self.model(tenant, body.get("model_id"))
        adapter = self.lora.adapters.get(model.model_id)
        return {
            "type": "get_info", "model_id": model.model_id, "model_data": {"model_name": self.base_model},
            "lora_rank": model.spec.rank, "target_modules": list(model.spec.target_modules),
            "optimizer_steps": adapter.steps if adapter else 0,
        }  # fmt: skip

    def saved_spec(self, tenant: Tenant, path: object) -> dict:
        """The LoRA config a saved state was made with (to create a training client that loads it)."""
        folder, _, kind = state.folder_of(self.state_dir, tenant.name, path)
        if kind != "weights":
            raise BadRequest(f"path {path}: not a saved training state (/weights/)")
        spec, steps, base = state.read_spec(folder)
        return {"rank": spec.rank, "target_modules": list(spec.target_modules), "seed": spec.seed - self.cfg.seed, "steps": steps, "base_model": base}

    def sample(self, tenant: Tenant, body: dict) -> str:
        """Tinker's ``asample``: from the tenant's training client (``model_id``: its current weights),
        a saved ``model_path`` (``save_weights_for_sampler``) or the base model; a future."""
        from noria.service.sampler import sampling_params

        if self.sampler is None:
            raise BadRequest("this service runs without a sampler (service.sampler: false)")
        prompt = read_prompt(body.get("prompt"), self.vocab)
        params, n = sampling_params(body.get("sampling_params"), body.get("num_samples", 1))
        model_id, path = body.get("model_id"), body.get("model_path")
        if model_id is not None and path is not None:
            raise BadRequest("sample: give model_id (the current weights) or model_path (saved ones), not both")
        model = self.model(tenant, model_id) if model_id is not None else None
        folder = self._sampler_folder(tenant, path) if path is not None else None
        base = body.get("base_model")
        if base is not None and base != self.base_model:
            raise BadRequest(f"base_model {base!r}: this service serves {self.base_model!r} only")

        def work():
            name = None
            if model is not None:
                name = self.sampler.current(self.lora, self._adapter(model))
            elif folder is not None:
                name = self.sampler.saved(tenant.name, path, folder)
            return self.sampler.sample(prompt, params, n, name)

        return self._submit(tenant, "sample", work, tokens=len(prompt) + n * params["max_new_tokens"])

    def _sampler_folder(self, tenant: Tenant, path: object) -> Path:
        return self._saved_folder(tenant, path, "sampler_weights",
                                  f"model_path {path}: sample takes sampler weights (/sampler_weights/, save_weights_for_sampler)")

    def _saved_folder(self, tenant: Tenant, path: object, kind: str, wrong_kind: str) -> Path:
        """The folder of the tenant's saved ``path`` (404 when it has none there, 400 when the path is
        malformed or of another kind than ``kind``: ``wrong_kind`` says which)."""
        try:
            folder, _, saved = state.folder_of(self.state_dir, tenant.name, path)
        except NotFound:
            raise
        except NoriaError as e:
            raise BadRequest(str(e)) from None
        if saved != kind:
            raise BadRequest(wrong_kind)
        return folder


def read_prompt(prompt: object, vocab: int) -> list[int]:
    from noria.service.wire import read_tokens

    return read_tokens(prompt, "prompt", vocab)
