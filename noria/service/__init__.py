"""``noria service``: a multi-tenant LoRA training service with Tinker's training primitives.

Many tenants train their own LoRA adapters on ONE frozen base model in one process. Each tenant has
an API key and quotas; it sees only its own adapters, futures and saved states.

Whether the real ``tinker`` SDK is the client: no. The SDK (checked at version 0.38) sends
``forward_backward`` as protobuf (optionally zstd-compressed) rather than JSON, exchanges the key for
a JWT, opens a session with heartbeats and telemetry before any call, and fetches a client config
from the server; following that private wire protocol would tie the service to one SDK release.
So the service answers Tinker's ROUTE NAMES with JSON bodies whose fields are Tinker's records
(``Datum``, ``ModelInput``, ``TensorData``, ``AdamParams``, ``try_again`` futures), and
``noria.service.client`` is the Python client, with the same primitives and futures.

How data moves::

    HTTP (server.py: auth, errors -> status codes)
      -> Service (core.py: find the tenant's model, read the body, take the quota)
      -> Scheduler (scheduler.py: per-tenant queues, one worker thread, tenants take turns)
      -> step.py (forward / forward_backward / optim_step on one adapter)   state.py (save / load)
      -> MultiLora (adapters.py: the frozen base, one peft adapter + AdamW per training client)

Modules: ``tenants`` (keys, quotas), ``wire`` (Tinker's JSON records), ``losses`` (cross_entropy,
importance_sampling, ppo on ``noria.train.objective``), ``client`` (the Python client).

Sampling: ``sampler`` (the built-in engine, each request with its adapter).
"""
