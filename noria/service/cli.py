"""The ``noria service`` subcommand: its flags, and turning them into a validated ``ServiceConfig``.

Light on purpose: ``noria --help`` builds this parser, so nothing heavy is imported at module level.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def add_service_parser(sub: argparse._SubParsersAction, handler: Callable) -> None:
    """Register ``noria service`` on the top-level subparsers."""
    p = sub.add_parser(
        "service",
        help="a multi-tenant LoRA training service with Tinker's primitives over HTTP (docs/service.md)",
        description="Load one base model and train many tenants' LoRA adapters on it: forward_backward with a named "
        "loss (cross_entropy, importance_sampling, ppo) returning per-token logprobs, optim_step, save and load state, "
        "save weights for sampling; every call is a future. Each tenant has an API key (service.keys_file, or one "
        "generated and printed at start) and quotas answered with 429.",
        epilog="Settings are dotted overrides, e.g. --service.keys_file keys.yaml --service.tokens_per_minute 100000 "
        "--model.dtype float32 (see `noria config --reference`); unknown keys are errors.",
    )
    p.add_argument("--model", required=True, help="catalog name (see `noria models list`) or HF model folder: the frozen base")
    p.add_argument("--config", help="YAML file with model and service sections (overrides apply after it)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.set_defaults(handler=handler, takes_overrides=True)


def load_service_config(config_file: str | None, model: str, overrides: list[str]):
    """``--model`` plus ``--model.*`` / ``--service.*`` / ``--engine.*`` overrides (after the YAML file), validated."""
    from noria.config import ConfigError, ServiceConfig, load_config

    for arg in overrides:
        key = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if key and not key.startswith(("service.", "model.", "engine.")):
            raise ConfigError(f"noria service takes only --service.*, --model.* and --engine.* overrides, got --{key}")
    return load_config(config_file, ["--model.path", model, *overrides], cls=ServiceConfig)


def run_service(args: argparse.Namespace, overrides: list[str]) -> int:
    """Validate the config, then serve (``noria.service.server.serve_service``) until stopped."""
    config = load_service_config(args.config, args.model, overrides)
    from noria.service.server import serve_service

    return serve_service(config, host=args.host, port=args.port)
