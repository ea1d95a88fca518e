"""The engine's HTTP server (``noria serve``): SGLang's native API and the OpenAI API over one ``Engine``.

What this package owns: translating HTTP requests into ``GenerateRequest`` records and
``GenerateOutput`` records back into SGLang-shaped (``text``, ``output_ids``, ``meta_info``) or
OpenAI-shaped JSON, the weight-update endpoints, and the server's life cycle. A real SGLang server
can stand in for it, and sglang-router can sit in front of it.

Modules, one concern each::

    app.py          EngineServer: phases (loading, ready, draining), middleware (API key, admission,
                    errors to JSON, body limits), in-flight tracking; serve() and the serve config
    native_api.py   SGLang's native generation, status and control endpoints
    weights_api.py  weight updates (SGLang's endpoints and Noria's stage / commit / checksum ones)
    openai_api.py   /v1/models, /v1/completions, /v1/chat/completions
    parsing.py      request parsing: closed, typed fields; errors name the field
    classify_api.py SGLang's /classify (reward models): the logits of a sequence-classification model
    classifier.py   SequenceClassifier: what noria serve runs for a *ForSequenceClassification folder

Every response carries the engine's weight version in the ``X-Weight-Version`` header, and
generation results carry the version that produced their tokens in the body.

Not guaranteed: streamed batches (``stream`` with a list of prompts) are refused; OpenAI function
calling, ``response_format``, ``echo`` and penalties are refused with a 400, not emulated.
"""

from noria.engine.server.app import EngineServer, ServeConfig, ServerOptions, engine_loader, load_serve_config, serve

__all__ = ["EngineServer", "ServeConfig", "ServerOptions", "engine_loader", "load_serve_config", "serve"]
