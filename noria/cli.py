"""The ``noria`` command: one subcommand per job, each with ``--help``.

Subcommands import their component lazily, so ``noria --help`` and config errors answer in well
under a second and before any model is loaded. Overrides are dotted config keys
(``--rollout.n_samples 8``); they are validated together with the YAML file before any heavy work.

``main`` first turns NVLink multicast off in the environment (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1; exported values win), so that every
process a command starts inherits it (see ``noria.process.env``).

Run as the process's command (``argv`` None), ``main`` freezes the heap when done (``gc.freeze``), so
that the interpreter's last collection skips what the exit frees anyway: 1.3 s of every ``noria
train`` exit, as long in each ``noria serve`` child (tiny model, 2-core EPYC Zen 4).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

from noria.errors import NoriaError

CONFIG_HELP = (
    "YAML config file (see examples/). Any config key can be overridden after it as a dotted option, "
    "e.g. --model.path DIR --eval.limit 50 --data.task_args.n_test 100; unknown keys are errors. "
    "`noria config --reference` lists every key with its type, default and meaning (docs/config.md); "
    "`noria config CONFIG [--key value ...]` prints the config resolved, without running anything."
)


def _eval(args: argparse.Namespace, overrides: list[str]) -> int:
    from noria.config import load_config
    from noria.eval import run_eval

    config = load_config(args.config, overrides)
    result = run_eval(config, run_dir=args.run_dir, output=args.output, progress=not args.no_progress)
    return 0 if result.n_scored > 0 else 1


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from noria.config import load_config

    from noria.console import phase, say
    from noria.process.lifecycle import sigterm_as_interrupt
    from noria.preflight import check_references

    sigterm_as_interrupt()  # SIGTERM stops the run as Ctrl-C does: step ends, logs flushed, children stopped
    os.umask(0o077)  # the run folder's files (trajectories, checkpoints, the model) are its owner's only
    from noria.run_folder import restart_folder, saved_config

    run_dir, resume = args.run_dir, args.resume
    restart = restart_folder(resume, run_dir) if args.restart else None
    config_file = args.config
    if config_file is None:  # `noria train --resume RUN`: the run's own resolved config
        if resume is None and restart is None:
            raise NoriaError("noria train needs a CONFIG file, or --resume RUN_DIR to continue a run with its own config")
        config_file = saved_config(restart or resume)
    config = load_config(config_file, overrides)
    from noria.train.memory import bound_onednn_cache

    bound_onednn_cache(config.train.onednn_cache_capacity)  # before any matmul (noria.train.memory)
    say(f"noria train: {config.name} ({config.train.algorithm}, model {config.model.path}); checking what the config names ...")
    # registry names, import paths, data files: before any folder or model. It imports the registries
    # (and so torch): a second on a quiet machine, 15 s on a busy one, so it beats like any phase.
    with phase("checking what the config names", start_line=False, end_line=False):
        check_references(config)
    progress = False if args.no_progress else None
    if restart is not None:  # a fresh run in the same folder, the old records moved aside first
        from noria.run_folder import move_aside

        moved = move_aside(restart)
        say(f"noria train: --restart: {restart} starts again from step 0" + (f"; its records were moved to {moved}" if moved else ""))
        run_dir, resume = str(restart), None
    if config.diffusion is not None:  # an image model (noria.diffusion): the same loop, its own parts
        from noria.diffusion.job import train_diffusion

        train_diffusion(config, run_dir=run_dir, resume=resume, progress=progress)
    else:  # RL or SFT: the job the Python API's noria.train runs too
        from noria.launch.api import run

        run(config, run_dir=run_dir, resume=resume, progress=progress)
    return 0


def _serve(args: argparse.Namespace, overrides: list[str]) -> int:
    from noria.engine.server import ServerOptions, load_serve_config, serve

    config = load_serve_config(args.model, overrides, args.dtype, args.device)
    from noria.train.memory import bound_onednn_cache

    bound_onednn_cache(config.engine.onednn_cache_capacity)  # before the model loads (noria.train.memory)
    options = ServerOptions(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        drain_timeout_s=args.drain_timeout,
        engine_id=args.engine_id or "",
        weight_version=args.weight_version,
        served_model_name=args.served_model_name or "",
        insecure_no_key=args.insecure_no_key,
    )
    from noria.diffusion.model import is_dit_folder

    if is_dit_folder(args.model):  # a diffusers DiT folder: the diffusion engine (noria.diffusion.server)
        from noria.diffusion.server import serve_diffusion

        return serve_diffusion(config, options)
    return serve(config, options)


def _service(args: argparse.Namespace, overrides: list[str]) -> int:
    from noria.service.cli import run_service

    return run_service(args, overrides)


def _machine_report() -> dict:
    """What ``noria info`` prints: versions, the CPU, the dtype ``auto`` picks, kernel builds, GPUs."""
    import torch

    from noria import __version__
    from noria.engine.kernels import build_status
    from noria.hardware import auto_dtype, cpu_info, packed_linear_ok

    info = cpu_info()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {
        "noria": __version__, "python": sys.version.split()[0], "torch": torch.__version__,
        "cpu": info.model, "isa": info.isa, "features": list(info.features), "acting_as": info.acting_as or "-",
        "torch_dispatch": info.torch_capability, "onednn_bf16": info.onednn_bf16, "bf16_native": info.bf16_native,
        "auto_dtype_cpu": auto_dtype("cpu"),
        "packed_linears": [d for d in ("float32", "bfloat16") if packed_linear_ok(getattr(torch, d))],
        "cpu_kernels": build_status(), "gpus": gpus,
    }  # fmt: skip


def _info(args: argparse.Namespace, overrides: list[str]) -> int:
    import json

    report = _machine_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for key, value in report.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, list):
            value = " ".join(map(str, value)) or "-"
        print(f"{key:<18} {value}")
    return 0


def _models_list(args: argparse.Namespace, overrides: list[str]) -> int:
    from noria.models.catalog import list_models

    rows = list_models()
    print(f"{'name':<26} {'available':<10} {'cached at':<50} description")
    for row in rows:
        cached = str(row["path"]) if row["path"] else "-"
        available = "yes" if row["installed"] else "no"
        print(f"{row['name']:<26} {available:<10} {cached:<50} {row['description']}")
    return 0


def _models_import(args: argparse.Namespace, overrides: list[str]) -> int:
    from noria.console import phase

    # noria.models imports torch and transformers: seconds on a quiet machine, far more on a busy one
    with phase(f"models import {args.name}: loading torch and transformers"):
        from noria.models.catalog import import_model

    path = import_model(args.name, force=args.force)
    print(f"{args.name}: {path}")
    return 0


def _config_show(args: argparse.Namespace, overrides: list[str]) -> int:
    import yaml

    from noria.config import RunConfig, load_config, to_dict
    from noria.config.schema import reference_text
    from noria.preflight import check_references

    if args.reference:
        print(reference_text(RunConfig), end="")
        return 0
    config = load_config(args.config, overrides)
    check_references(config)  # what `noria train` would refuse, refused here too
    print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
    return 0


def _report(args: argparse.Namespace, overrides: list[str]) -> int:
    from noria.runview.report import write_report

    page = write_report(args.run_dir, args.out)
    print(f"noria report: {page} (plots as PNG files beside it)")
    return 0


def _inspect(args: argparse.Namespace, overrides: list[str]) -> int:
    from noria.runview.trajectories import inspect_step

    inspect_step(args.run_dir, args.step, args.group, args.limit, tokens=not args.no_tokens)
    return 0


def _docs(args: argparse.Namespace, overrides: list[str]) -> int:
    from pathlib import Path

    from noria.runview.docs import stale_docs, write_docs

    folder = Path(args.out) if args.out else None
    if args.check:
        stale = stale_docs(folder)
        if stale:
            print(f"noria docs: stale: {', '.join(stale)}; run `noria docs` to regenerate", file=sys.stderr)
            return 1
        print("noria docs: generated pages are up to date")
        return 0
    for path in write_docs(folder):
        print(f"noria docs: wrote {path}")
    return 0


def _fleet(args: argparse.Namespace, overrides: list[str]) -> int:
    from noria.launch import elastic

    if args.fleet_command == "status":
        for e in elastic.status(args.run_dir):
            left = f" ({e['left']})" if e["left"] else ""
            print(f"engine {e['engine']}  {e['state']:<9}  version {e['version']}  {e['url']}{left}")
        return 0
    if args.fleet_command == "add":
        request = {"action": "add", "n": args.n}
    else:
        request = {"action": "remove", "engine": args.engine}
    answer = elastic.ask(args.run_dir, request, args.timeout)
    print(f"noria fleet {args.fleet_command}: {answer['message']}", file=sys.stdout if answer["ok"] else sys.stderr)
    return 0 if answer["ok"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="noria",
        description="Noria: RL post-training of LLMs. Each subcommand has its own --help.",
    )
    from noria import __version__

    parser.add_argument("--version", action="version", version=f"noria {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_job_commands(sub)
    _add_model_commands(sub)
    _add_bench_commands(sub)
    _add_run_commands(sub)
    _add_fleet_commands(sub)
    return parser


def _add_fleet_commands(sub: argparse._SubParsersAction) -> None:
    """``noria fleet add | remove | status``: the engine fleet of a running job (``noria.launch.elastic``)."""
    fleet = sub.add_parser(
        "fleet",
        help="add engines to a running RL job, or drain and remove one, without a restart",
        description="Acts on the engine fleet of a `noria train` running in RUN_DIR (rollout.engines > 1, or "
        "rollout.elastic: true) through a request file in the run folder, which only its owner can write. The job "
        "acts at its next safe point (while the trainer waits for groups) and answers; this command waits for it.",
    )
    fsub = fleet.add_subparsers(dest="fleet_command", metavar="ACTION", required=True)
    p = fsub.add_parser(
        "add",
        help="start engines, push them the current weights (checksums verified), then route to them",
        description="Ask the job running in RUN_DIR for --n more engines: each starts outside the router, gets the "
        "run's current weights with checksums verified, and only then joins the router. The answer names each engine "
        "and its verified version (docs/scale.md, 'Elastic fleets').",
    )
    p.add_argument("run_dir", help="run folder of the running job")
    p.add_argument("--n", type=int, default=1, help="engines to add (default 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the answer (default 600)")
    p.set_defaults(handler=_fleet, takes_overrides=False)
    p = fsub.add_parser(
        "remove",
        help="take an engine out of the router, let its requests finish or move, then stop it",
        description="Ask the job running in RUN_DIR to remove ENGINE (default: the newest one serving): it leaves the "
        "router at once, finishes its admitted requests for at most rollout.engine_drain_s, and the groups of those "
        "it did not finish are generated again on the other engines. The last serving engine is never removed.",
    )
    p.add_argument("run_dir", help="run folder of the running job")
    p.add_argument("engine", type=int, nargs="?", help="engine index (noria fleet status; default the newest serving one)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the answer (default 600)")
    p.set_defaults(handler=_fleet, takes_overrides=False)
    p = fsub.add_parser(
        "status",
        help="the fleet's engines as the job last recorded them",
        description="One line per engine of RUN_DIR/fleet/engines.json: index, state, weight version, URL and, for "
        "an engine that left, why. Reads the run folder only; the job need not be running.",
    )
    p.add_argument("run_dir", help="run folder of the job")
    p.set_defaults(handler=_fleet, takes_overrides=False)


def _add_job_commands(sub: argparse._SubParsersAction) -> None:
    """``noria info``, ``eval``, ``train`` (and ``serve``: ``_add_serve_command``)."""
    p = sub.add_parser(
        "info",
        help="this machine as Noria sees it: CPU features, the dtype `auto` picks, kernel builds, GPUs",
        description="What every fast path decides from: the CPU's instruction sets (AVX2, AVX-512, "
        "AVX512_BF16, AMX), what torch and oneDNN accept, the dtype model.dtype: auto resolves to, and "
        "whether the C++ kernels for this CPU are built. NORIA_CPU_ISA=avx2 makes Noria act as on an "
        "AVX2-only CPU.",
    )
    p.add_argument("--json", action="store_true", help="print the same as one JSON object")
    p.set_defaults(handler=_info, takes_overrides=False)

    p = sub.add_parser(
        "eval",
        help="accuracy of a model on a task's held-out split",
        description="Generate answers for a task's test split, score them with the configured reward, "
        "print a table and write eval.json (and the samples) into the run folder.",
        epilog=CONFIG_HELP,
    )
    p.add_argument("config", help="YAML config with model, data, reward and eval sections")
    p.add_argument("--run-dir", help="folder for the resolved config, eval.json and samples (default runs/eval-<name>-<time>)")
    p.add_argument("--output", help="also write the result JSON to this path")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (plain log lines only)")
    p.set_defaults(handler=_eval, takes_overrides=True)

    p = sub.add_parser(
        "train",
        help="train a model: RL (GRPO and friends, train.algorithm rl), SFT (train.algorithm sft) or a reward model "
        "(train.algorithm reward_model)",
        description="RL (train.algorithm rl): the loop of rollout on the engine (colocated in this "
        "process, or disaggregated as a `noria serve` process: rollout.placement), rewards, trainer "
        "steps and weight sync, with evaluation every eval.every steps on the rollout engine. "
        "SFT (train.algorithm sft): multi-turn chat JSONL, loss on assistant tokens only. "
        "Reward model (train.algorithm reward_model): pairwise Bradley-Terry on preference pairs (JSONL of prompt, "
        "chosen, rejected, or pairs made from data.task), saved as a sequence-classification folder for reward.model. "
        "All write the resolved config, metrics.jsonl, events.jsonl, checkpoints every train.save_every steps and "
        "at the end (train.save_final_state; continue or extend with --resume RUN_DIR) and the final HF model "
        "(RUN_DIR/final) into the run folder; no later run on the folder deletes what it recorded. "
        "train.backend fsdp2 with train.world_size N spawns N local ranks; SFT also runs as one rank "
        "under `torchrun --nproc-per-node N -m noria.cli train ...`.",
        epilog=CONFIG_HELP,
    )
    p.add_argument(
        "config", nargs="?",
        help="YAML config with model, data and train sections (see examples/); with --resume it may be left out: "
        "the run's own config.yaml is used",
    )
    p.add_argument("--run-dir", help="run folder (default runs/<name>-<time>); must not hold a run already")
    p.add_argument(
        "--resume", metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last committed checkpoint (a finished run's too: a larger "
        "--train.max_steps extends it); without CONFIG, with RUN_DIR/config.yaml (overrides such as --train.max_steps "
        "still apply); with CONFIG, every difference from the run's config is named. Refused, with nothing written, "
        "when RUN_DIR has no checkpoint but records steps; what was recorded after the checkpoint moves to RUN_DIR/superseded/",
    )
    p.add_argument(
        "--restart", action="store_true",
        help="start the run in RUN_DIR (--resume RUN_DIR or --run-dir RUN_DIR) again from step 0: everything it "
        "recorded (config, metrics, checkpoints, final/, ...) is moved, never deleted, into RUN_DIR/previous-<time>/; "
        "without CONFIG, RUN_DIR/config.yaml is used (overrides apply)",
    )
    p.add_argument("--no-progress", action="store_true", help="plain log lines even on a terminal")
    p.set_defaults(handler=_train, takes_overrides=True)
    _add_serve_command(sub)
    from noria.service.cli import add_service_parser

    add_service_parser(sub, _service)


def _add_serve_command(sub: argparse._SubParsersAction) -> None:
    """``noria serve``."""
    p = sub.add_parser(
        "serve",
        help="serve a model over HTTP (SGLang native API and OpenAI API)",
        description="Start the built-in engine behind an HTTP server that speaks SGLang's native API "
        "(/generate, /update_weights_from_disk, ...) and the OpenAI API (/v1/completions, "
        "/v1/chat/completions). The port answers 503 while the model loads; SIGTERM drains in-flight "
        "requests (at most --drain-timeout seconds), aborts the rest and exits 0.",
        epilog="Engine and model settings are dotted overrides, e.g. --engine.max_running_requests 64 "
        "--engine.kv_cache_tokens 65536 (see `noria config --reference`); unknown keys are errors.",
    )
    p.add_argument("--model", required=True, help="catalog name (see `noria models list`) or HF model folder")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback only)")
    p.add_argument("--port", type=int, default=30000, help="TCP port (default 30000)")
    p.add_argument(
        "--api-key", default=os.environ.get("NORIA_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every endpoint (default: $NORIA_API_KEY, which keeps the key "
        "off the command line that every local user can read)",
    )
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], help="weights dtype (default auto: see noria info)")
    p.add_argument("--device", help="torch device (default cpu)")
    p.add_argument("--weight-version", type=int, help="weight version reported before any update (default: the engine's)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to drain in-flight requests on SIGTERM (default 30)")
    p.add_argument("--engine-id", help="name of this engine in /server_info and meta_info (default host:port)")
    p.add_argument("--served-model-name", help="model id in the OpenAI API (default the model path)")
    p.add_argument(
        "--insecure-no-key", action="store_true",
        help="serve beyond loopback (--host) without an API key; refused otherwise: anyone who reaches the port "
        "could generate and replace the weights",
    )
    p.set_defaults(handler=_serve, takes_overrides=True)


def _add_model_commands(sub: argparse._SubParsersAction) -> None:
    """``noria models list | import``."""
    models = sub.add_parser(
        "models",
        help="list and import models that need no hub",
        description="Models Noria can build locally from PyPI packages, with no model hub.",
    )
    msub = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    p = msub.add_parser(
        "list",
        help="show catalog models, whether they can be built here, and where they are cached",
        description="One line per catalog model: its name (what model.path and `noria models import` take), whether "
        "it can be built on this machine (its PyPI package is installed, or it needs none), the folder it is cached "
        "in under $NORIA_HOME/models once imported, and what it is. Any HF model folder works as model.path too.",
    )
    p.set_defaults(handler=_models_list, takes_overrides=False)
    p = msub.add_parser(
        "import",
        help="build an HF model folder (weights, tokenizer, chat template) from a catalog entry",
        description="Build the model folder once and cache it under $NORIA_HOME/models "
        "(default ~/.cache/noria/models). Later imports return the cached folder.",
    )
    p.add_argument("name", help="catalog name, e.g. smollm2-135m-instruct (see `noria models list`)")
    p.add_argument("--force", action="store_true", help="rebuild even if a cached folder exists")
    p.set_defaults(handler=_models_import, takes_overrides=False)


def _add_bench_commands(sub: argparse._SubParsersAction) -> None:
    """``noria bench NAME``: every benchmark module declares its own arguments (``noria.bench``)."""
    bench = sub.add_parser(
        "bench",
        help="benchmarks that measure Noria and its peers side by side",
        description="Each benchmark prints one table and, with --json PATH, writes its figures as JSON. "
        "Compare ratios within one run: these machines are noisy. `noria bench NAME --help` lists a "
        "benchmark's own options.",
    )
    from noria.bench import add_parsers

    add_parsers(bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True))


def _add_run_commands(sub: argparse._SubParsersAction) -> None:
    """``noria config``, ``report``, ``inspect``, ``docs``."""
    p = sub.add_parser(
        "config",
        help="print a resolved config, or the reference of every key",
        description="Load a config with overrides exactly as a job would, validate it, and print it resolved.",
        epilog=CONFIG_HELP,
    )
    p.add_argument("config", nargs="?", help="YAML config file")
    p.add_argument("--reference", action="store_true", help="print every config key with its type, default and meaning")
    p.set_defaults(handler=_config_show, takes_overrides=True)

    p = sub.add_parser(
        "report",
        help="an HTML page of a run's curves (and the curves as PNG files)",
        description="Read RUN_DIR (config.yaml, metrics.jsonl, eval.jsonl, rollouts/) and write one self-contained "
        "HTML page with plots of reward and held-out accuracy, KL and entropy, rollout-vs-trainer logprob "
        "difference, tokens/s, stage times, buffer size and staleness, and weight-sync time, plus the resolved "
        "config; every plot is also written as a PNG. Works on a run in progress.",
    )
    p.add_argument("run_dir", help="run folder of `noria train`")
    p.add_argument("--out", help="output folder (default RUN_DIR/report)")
    p.set_defaults(handler=_report, takes_overrides=False)

    p = sub.add_parser(
        "inspect",
        help="a step's sampled trajectories with reward, status, per-token loss mask and logprobs",
        description="Print the trajectories of one RL step from RUN_DIR/rollouts/step-N.jsonl: per group the prompt "
        "and label, per sample reward, status, response, and one line per token (text, loss mask, logprob "
        "with a probability bar, weight version).",
    )
    p.add_argument("run_dir", help="run folder of `noria train` (train.algorithm rl)")
    p.add_argument("--step", type=int, help="rollout step (default: the last one written)")
    p.add_argument("--group", type=int, help="only this group id")
    p.add_argument("--limit", type=int, default=8, help="samples shown at most (default 8; 0 shows all)")
    p.add_argument("--no-tokens", action="store_true", help="one summary block per sample, no per-token lines")
    p.set_defaults(handler=_inspect, takes_overrides=False)

    p = sub.add_parser(
        "docs",
        help="regenerate docs/config.md and docs/metrics.md from the code (--check: fail if stale)",
        description="The configuration reference comes from the config classes (noria/config/), the metrics "
        "reference from noria.metric_names.METRICS.",
    )
    p.add_argument("--check", action="store_true", help="exit 1 if a generated page differs from the code")
    p.add_argument("--out", help="docs folder (default the repository's docs/)")
    p.set_defaults(handler=_docs, takes_overrides=False)


def split_overrides(argv: list[str], own_options: set[str], is_flag=lambda key: False) -> tuple[list[str], list[str]]:
    """Separate config overrides (``--key VALUE`` / ``--key=VALUE`` / ``--flag``) from a subcommand's own args.

    An option the subcommand does not define is an override. It takes the next token as its value
    unless that token is another option, or the key is a boolean (``is_flag``) and the token is not
    a boolean word: so ``--sync.verify CONFIG`` leaves the positional config path alone.
    """
    own, overrides, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if arg.startswith("--") and name not in own_options and arg != "--":
            overrides.append(arg)
            if "=" not in arg and i + 1 < len(argv) and _is_value(argv[i + 1], name[2:], is_flag):
                overrides.append(argv[i + 1])
                i += 1
        elif arg.startswith("-") and not arg.startswith("--") and "." in arg and name not in own_options:
            raise NoriaError(f"{arg}: config overrides take two dashes: -{arg}")
        else:
            own.append(arg)
        i += 1
    return own, overrides


def _is_value(token: str, key: str, is_flag) -> bool:
    """Whether ``token`` is the value of override ``--key`` (not the next option or a positional)."""
    if token.startswith("--"):
        return False
    key = key.replace("-", "_")
    if is_flag(key) or (key.startswith("no_") and is_flag(key[3:])):
        return not token.endswith((".yaml", ".yml"))  # `--sync.verify CONFIG`: the path is the positional
    return True


def _override_flags(command: str):
    """The boolean-field test for a subcommand's overrides (``noria serve`` has its own config class)."""
    from noria.config.schema import is_bool_key

    if command == "serve":
        from noria.engine.server.app import ServeConfig as cls
    else:
        from noria.config import RunConfig as cls
    return lambda key: is_bool_key(cls, key)


def line_buffered() -> None:
    """stdout and stderr flush at every line, also into a file or pipe (``noria train ... > log``),
    and so do the Python processes a command starts (PYTHONUNBUFFERED is inherited)."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)


def main(argv: list[str] | None = None) -> int:
    from noria.process.env import multicast_off

    multicast_off()  # before any process group; every child process inherits it (noria.process.env)
    line_buffered()
    try:
        return _dispatch(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:
        # The reader went away (`noria config --reference | head`): stop quietly, as Unix tools do.
        # stdout is pointed at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        if argv is None:  # the process ends with this command (module docstring)
            gc.freeze()


def _dispatch(argv: list[str]) -> int:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = subparsers.choices.get(argv[0]) if argv else None
    overrides: list[str] = []
    if sub is not None and sub.get_default("takes_overrides"):
        own_options = {s for action in sub._actions for s in action.option_strings}
        try:
            rest, overrides = split_overrides(argv[1:], own_options, _override_flags(argv[0]))
        except NoriaError as e:
            sub.error(str(e))
        argv = [argv[0], *rest]
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "parses_rest", False):  # a benchmark parses its own arguments (noria.bench)
        overrides = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.handler(args, overrides)
    except (NoriaError, FileNotFoundError) as e:
        # Bad input names its file, row or field: one line, no traceback.
        print(f"noria {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM where the command turned it into one
        from noria.process.lifecycle import exit_code

        print(f"noria {args.command}: stopped ({str(e) or 'interrupted (Ctrl-C)'})", file=sys.stderr, flush=True)
        return exit_code(e)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
