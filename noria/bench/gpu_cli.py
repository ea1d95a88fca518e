"""Command-line entries of the GPU benchmarks (``noria bench gpu-engine | gpu-train | gpu-sync``)."""

from __future__ import annotations

import argparse


def _csv(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def _engine(args: argparse.Namespace, overrides: list[str]) -> int:
    from noria.bench import gpu_engine

    gpu_engine.run(_csv(args.models), [int(b) for b in _csv(args.batches)], args.prompt_len, args.new_tokens,
                   args.hf_new_tokens, tuple(_csv(args.peers)), not args.no_deterministic, args.json)
    return 0


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from noria.bench import gpu_train

    gpu_train.run(args.model, args.sequences, args.min_len, args.max_len, args.steps, args.warmup,
                  args.micro_batch_tokens, not args.no_checkpointing, compile=args.compile, json_path=args.json)
    return 0


def _sync(args: argparse.Namespace, overrides: list[str]) -> int:
    from noria.bench import gpu_sync

    gpu_sync.run(args.model, tuple(_csv(args.transports)), args.bucket_mb, args.repeats, args.json)
    return 0


def _fp8(args: argparse.Namespace, overrides: list[str]) -> int:
    from noria.bench import gpu_fp8

    gpu_fp8.run(args.model, args.batch, args.prompt_len, args.new_tokens, args.json)
    return 0


def _profile(args: argparse.Namespace, overrides: list[str]) -> int:
    from noria.bench import gpu_profile

    gpu_profile.run([int(b) for b in _csv(args.batches)], args.context, args.model, args.json,
                    sweep=not args.no_sweep, unfused=not args.no_unfused)
    return 0


def _module(name: str):
    """A GPU benchmark module that declares its own arguments: ``add_arguments(parser)`` and
    ``main(args) -> int`` (imported when the parser is built: keep torch out of its top level)."""
    import importlib

    return importlib.import_module(f"noria.bench.{name}")


def _module_parser(bsub, command: str, module: str, help: str) -> None:
    mod = _module(module)
    p = bsub.add_parser(command, help=help)
    mod.add_arguments(p)
    p.set_defaults(handler=lambda args, overrides: mod.main(args), takes_overrides=False)


def add_parsers(bsub) -> None:
    """Register the GPU benchmarks under ``noria bench``."""
    p = bsub.add_parser("gpu-engine", help="CUDA: decode tokens/s of the engine vs HF generate and the bandwidth bound")
    p.add_argument("--models", default="qwen3-0.6b,qwen3-1.7b", help="random-init Qwen3 sizes: qwen3-0.6b, qwen3-1.7b")
    p.add_argument("--batches", default="64,256")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--hf-new-tokens", type=int, default=128, help="new tokens of the HF generate peer")
    p.add_argument("--peers", default="hf_generate", help="comma list: hf_generate, noria_no_overlap (the engine with engine.overlap off), or empty")
    p.add_argument("--no-deterministic", action="store_true", help="skip the deterministic-mode row")
    p.add_argument("--json", help="write the figures to this JSON file")
    p.set_defaults(handler=_engine, takes_overrides=False)

    p = bsub.add_parser("gpu-train", help="CUDA: tokens/s and MFU of one RL step on a random Qwen3-shaped model")
    p.add_argument("--model", default="qwen3-1.7b")
    p.add_argument("--sequences", type=int, default=24)
    p.add_argument("--min-len", type=int, default=512)
    p.add_argument("--max-len", type=int, default=1536)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--no-checkpointing", action="store_true", help="no activation checkpointing")
    p.add_argument("--compile", action="store_true", help="train.compile: torch.compile each decoder layer")
    p.add_argument("--json", help="write the figures to this JSON file")
    p.set_defaults(handler=_train, takes_overrides=False)

    p = bsub.add_parser("gpu-sync", help="CUDA: weight push to a colocated engine (CUDA IPC) vs a device copy")
    p.add_argument("--model", default="qwen3-1.7b")
    p.add_argument("--transports", default="ipc,ipc_shm")
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the figures to this JSON file")
    p.set_defaults(handler=_sync, takes_overrides=False)

    p = bsub.add_parser("gpu-fp8", help="CUDA (Hopper): FP8 vs bf16 rollout, decode speed and logprob mismatch (TIS)")
    p.add_argument("--model", default="qwen3-1.7b")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--json", help="write the figures to this JSON file")
    p.set_defaults(handler=_fp8, takes_overrides=False)

    p = bsub.add_parser("gpu-profile", help="CUDA: decode kernel vs bandwidth (tile sweep) and one decode step's breakdown")
    p.add_argument("--batches", default="64,256")
    p.add_argument("--context", type=int, default=768)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--no-sweep", action="store_true", help="skip the attention kernel's tile sweep")
    p.add_argument("--no-unfused", action="store_true", help="skip the steps without the fused decoder")
    p.add_argument("--json", help="write the figures to this JSON file")
    p.set_defaults(handler=_profile, takes_overrides=False)

    _module_parser(bsub, "gpu-rl", "gpu_rl",
                   "CUDA: the main job's algorithm on a random Qwen3-shaped model, seconds per step and stage shares")
    _module_parser(bsub, "gpu-multi", "gpu_multi",
                   "several CUDA GPUs: FSDP2 over 2 GPUs vs 1, async RL with engine and trainer on separate GPUs")
